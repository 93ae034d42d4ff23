//! A second process for end-to-end tests: stores or retrieves through libmaru
//! or the mount and prints what it saw (bytes' checksum, physical frames), or runs a
//! list of operations on either door and prints each one's answer (permission tests).

use std::io::Write;

use maru_tests::{ReadCounts, pattern, pfns, set_xattr};

fn cfg(socket: &str) -> maru::Config {
    maru::Config {
        socket: socket.into(),
        ..Default::default()
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut out = std::io::stdout().lock();
    match a.get(1..) {
        // store SOCKET PATH SIZE SEED -> prints PFNs of the first and last page
        Some(["store", sock, path, size, seed]) => {
            // Saying where it publishes: a small entry is packed.
            let h = maru::Handler::connect(maru::Config {
                namespace: path.rsplit_once('/').map(|(ns, _)| ns.to_owned()),
                ..cfg(sock)
            })?;
            let size: usize = size.parse()?;
            let mut al = h.alloc(size as u64)?;
            al.as_mut_slice()
                .copy_from_slice(&pattern(seed.parse()?, size));
            let p = pfns(al.as_slice().as_ptr(), size);
            h.store(path, al)?;
            writeln!(out, "{} {}", p[0], p[p.len() - 1])?;
        }
        // retrieve SOCKET PATH SEED -> prints PFNs of the first and last page, checks bytes
        Some(["retrieve", sock, path, seed]) => {
            let h = maru::Handler::connect(cfg(sock))?;
            let m = h
                .retrieve(path)?
                .ok_or_else(|| anyhow::anyhow!("{path} not found"))?;
            anyhow::ensure!(
                m.as_slice() == pattern(seed.parse()?, m.len()),
                "bytes differ"
            );
            let p = pfns(m.as_ptr(), m.len());
            writeln!(out, "{} {}", p[0], p[p.len() - 1])?;
        }
        // hold SOCKET SIZE PATH: allocate (never publish), retrieve PATH (lease), then sleep
        Some(["hold", sock, size, path]) => {
            let h = maru::Handler::connect(cfg(sock))?;
            let mut al = h.alloc(size.parse()?)?;
            al.as_mut_slice().fill(1);
            let _m = h.retrieve(path)?;
            writeln!(out, "holding")?;
            out.flush()?;
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        // readfile FILE SEED -> reads a file under the mount via mmap, prints len and PFN
        Some(["mapfile", file, seed]) => {
            let f = std::fs::File::open(file)?;
            // SAFETY: read-only mapping of a sealed entry.
            let m = unsafe { memmap2::Mmap::map(&f)? };
            anyhow::ensure!(m[..] == pattern(seed.parse()?, m.len())[..], "bytes differ");
            let p = pfns(m.as_ptr(), m.len());
            writeln!(out, "{} {}", m.len(), p[0])?;
        }
        // try SOCKET OP PATH -> prints `ok` or the error kind (for permission tests)
        Some(["try", sock, op, path]) => {
            let r = maru::Handler::connect(cfg(sock)).and_then(|h| match *op {
                "retrieve" => h.retrieve(path).map(drop),
                "exists" => h.exists(path).map(drop),
                "put" => h.put(path, b"intruder"),
                "delete" => h.delete(path),
                "pin" => h.pin(path),
                "mkdir" => h.mkdir(path, 0o755),
                "quota" => h.set_quota(path, None),
                _ => Err(maru::Error::InvalidArgument(format!("unknown op {op}"))),
            });
            match r {
                Ok(()) => writeln!(out, "ok")?,
                Err(e) => writeln!(out, "{}", e.kind())?,
            }
        }
        // openwait SOCKET FLAG N PATH... -> retrieves the first N paths in one batch, then
        // each other path before FLAG exists, and each path after `--` once it does (a path
        // `exists:P` asks whether P exists instead); prints one line per step (`ok`, `absent`,
        // `true`, `false` or the error kind) and, after each part, the
        // store's `retrieve` and `accessed` op counts and retrieved bytes (its own request
        // carries this client's report of what it opened itself).
        Some(["openwait", sock, flag, n, paths @ ..]) => {
            let h = maru::Handler::connect(cfg(sock))?;
            let (batch, rest) = paths.split_at(n.parse()?);
            for r in h.batch_retrieve(batch)? {
                writeln!(out, "{}", if r.is_some() { "ok" } else { "absent" })?;
            }
            let mut after = false;
            for p in rest {
                if *p == "--" {
                    writeln!(out, "{}", ReadCounts::of(&h)?)?;
                    out.flush()?;
                    while !std::path::Path::new(flag).exists() {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    after = true;
                    continue;
                }
                if let Some(p) = p.strip_prefix("exists:") {
                    match h.exists(p) {
                        Ok(b) => writeln!(out, "{b}")?,
                        Err(e) => writeln!(out, "{}", e.kind())?,
                    }
                    continue;
                }
                match h.retrieve(p) {
                    Ok(Some(_)) => writeln!(out, "ok")?,
                    Ok(None) => writeln!(out, "absent")?,
                    Err(e) => writeln!(out, "{}", e.kind())?,
                }
            }
            anyhow::ensure!(after, "no `--` in the paths");
            writeln!(out, "{}", ReadCounts::of(&h)?)?;
        }
        // storeloop SOCKET NS PREFIX SIZE -> stores PREFIX-0, PREFIX-1... forever, printing
        // each key once the daemon acknowledged it (seed = index)
        Some(["storeloop", sock, ns, prefix, size]) => {
            let h = maru::Handler::connect(cfg(sock))?;
            let size: usize = size.parse()?;
            for i in 0u64.. {
                let mut a = h.alloc(size as u64)?;
                a.as_mut_slice().copy_from_slice(&pattern(i, size));
                h.store(&format!("{ns}/{prefix}-{i}"), a)?;
                writeln!(out, "{i}")?;
                out.flush()?;
            }
        }
        // ops SOCKET MOUNT STEP... -> runs each step (`DOOR:OP:PATH[:ARG]`, DOOR `socket` or
        // `mount`) as this process's user and prints one line per step: `STEP ok` or
        // `STEP errno N MESSAGE`. A failed step does not stop the others.
        Some(["ops", sock, mount, steps @ ..]) => {
            let mut doors = Doors {
                socket: sock,
                mount: std::path::Path::new(mount),
                handler: None,
            };
            for step in steps {
                match doors.run(step) {
                    Ok(()) => writeln!(out, "{step} ok")?,
                    Err((errno, msg)) => writeln!(out, "{step} errno {errno} {msg}")?,
                }
            }
        }
        _ => anyhow::bail!(
            "usage: maru-probe store|retrieve|hold|mapfile|try|openwait|storeloop|ops ..."
        ),
    }
    Ok(())
}

/// The two doors to the store, for `ops`: the control socket (libmaru) and the mount.
struct Doors<'a> {
    socket: &'a str,
    mount: &'a std::path::Path,
    handler: Option<maru::Handler>,
}

/// A step's failure: the errno and a message.
type StepError = (i32, String);

fn io_err(e: std::io::Error) -> StepError {
    (e.raw_os_error().unwrap_or(libc::EIO), e.to_string())
}

fn maru_err(e: maru::Error) -> StepError {
    (e.errno(), e.to_string())
}

/// What `ops` writes into the entries it creates.
const OPS_BYTES: &[u8] = b"written by maru-probe ops";

impl Doors<'_> {
    fn handler(&mut self) -> Result<&maru::Handler, StepError> {
        if self.handler.is_none() {
            self.handler = Some(maru::Handler::connect(cfg(self.socket)).map_err(maru_err)?);
        }
        Ok(self.handler.as_ref().expect("connected above"))
    }

    fn run(&mut self, step: &str) -> Result<(), StepError> {
        let parts: Vec<&str> = step.splitn(4, ':').collect();
        let (door, op, path, arg) = match parts[..] {
            [door, op, path] => (door, op, path, None),
            [door, op, path, arg] => (door, op, path, Some(arg)),
            _ => return Err((libc::EINVAL, format!("bad step {step}"))),
        };
        let mode = || {
            arg.and_then(|a| u32::from_str_radix(a, 8).ok())
                .ok_or((libc::EINVAL, format!("{step}: no octal mode")))
        };
        match door {
            "socket" => {
                let h = self.handler()?;
                let absent = || (libc::ENOENT, format!("{path} not found"));
                match op {
                    "mkdir" => h.mkdir(path, mode()?).map_err(maru_err),
                    "lookup" => match h.exists(path).map_err(maru_err)? {
                        true => Ok(()),
                        false => Err(absent()),
                    },
                    "list" => h.list(path).map(drop).map_err(maru_err),
                    "read" => match h.retrieve(path).map_err(maru_err)? {
                        Some(_) => Ok(()),
                        None => Err(absent()),
                    },
                    "create" => h.put(path, OPS_BYTES).map_err(maru_err),
                    "delete" => h.delete(path).map_err(maru_err),
                    "pin" => h.pin(path).map_err(maru_err),
                    "quota" => h.set_quota(path, Some(1 << 30)).map_err(maru_err),
                    _ => Err((libc::EINVAL, format!("no socket op {op}"))),
                }
            }
            "mount" => {
                use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
                let p = self.mount.join(path);
                match op {
                    "mkdir" => std::fs::create_dir(&p).map_err(io_err),
                    "chmod" => {
                        let perms = std::fs::Permissions::from_mode(mode()?);
                        std::fs::set_permissions(&p, perms).map_err(io_err)
                    }
                    "lookup" => std::fs::metadata(&p).map(drop).map_err(io_err),
                    "list" => std::fs::read_dir(&p)
                        .and_then(|d| d.collect::<std::io::Result<Vec<_>>>())
                        .map(drop)
                        .map_err(io_err),
                    "read" => std::fs::read(&p).map(drop).map_err(io_err),
                    "create" => {
                        let mut f = std::fs::OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .mode(0o644)
                            .open(&p)
                            .map_err(io_err)?;
                        f.write_all(OPS_BYTES).map_err(io_err)?;
                        // close(2)'s answer is part of the store's: don't let drop ignore it.
                        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
                        // SAFETY: `fd` was just released by the File, closed exactly once.
                        match unsafe { libc::close(fd) } {
                            0 => Ok(()),
                            _ => Err(io_err(std::io::Error::last_os_error())),
                        }
                    }
                    "delete" => std::fs::remove_file(&p).map_err(io_err),
                    "pin" => set_xattr(&p, "user.maru.pinned", b"1").map_err(io_err),
                    _ => Err((libc::EINVAL, format!("no mount op {op}"))),
                }
            }
            _ => Err((libc::EINVAL, format!("no door {door}"))),
        }
    }
}
