//! A second process for end-to-end tests: stores or retrieves through libmaru
//! or the mount and prints what it saw (bytes' checksum, physical frames).

use std::io::Write;

use maru_tests::{pattern, pfns};

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
            let h = maru::Handler::connect(cfg(sock))?;
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
        _ => anyhow::bail!("usage: maru-probe store|retrieve|hold|mapfile|try|storeloop ..."),
    }
    Ok(())
}
