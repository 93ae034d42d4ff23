//! Random sequences of filesystem operations run against the real mount (and through
//! libmaru, the other door) and against an in-memory model; they must agree.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};

use maru_tests::{Daemon, Opts, pattern};
use proptest::prelude::*;
use proptest::prop_assert_eq;

#[derive(Debug, Clone)]
enum FsOp {
    Mkdir(u8),
    Rmdir(u8),
    Write(u8, u8, u16),
    LibPut(u8, u8, u16),
    Read(u8, u8),
    LibGet(u8, u8),
    Unlink(u8, u8),
    Rename(u8, u8, u8, u8),
    List(u8),
}

fn op() -> impl Strategy<Value = FsOp> {
    let d = 0u8..3;
    let k = 0u8..4;
    prop_oneof![
        d.clone().prop_map(FsOp::Mkdir),
        d.clone().prop_map(FsOp::Rmdir),
        (d.clone(), k.clone(), 0u16..9000).prop_map(|(a, b, c)| FsOp::Write(a, b, c)),
        (d.clone(), k.clone(), 1u16..9000).prop_map(|(a, b, c)| FsOp::LibPut(a, b, c)),
        (d.clone(), k.clone()).prop_map(|(a, b)| FsOp::Read(a, b)),
        (d.clone(), k.clone()).prop_map(|(a, b)| FsOp::LibGet(a, b)),
        (d.clone(), k.clone()).prop_map(|(a, b)| FsOp::Unlink(a, b)),
        (d.clone(), k.clone(), d.clone(), k.clone())
            .prop_map(|(a, b, c, e)| FsOp::Rename(a, b, c, e)),
        d.prop_map(FsOp::List),
    ]
}

#[derive(Default, Debug)]
struct Model {
    dirs: BTreeMap<u8, BTreeMap<u8, Vec<u8>>>,
}

type Outcome = Result<Option<Vec<u8>>, i32>;

impl Model {
    fn apply(&mut self, op: &FsOp, seed: u64) -> Outcome {
        use libc::{EEXIST, ENOENT, ENOTEMPTY};
        match *op {
            FsOp::Mkdir(d) => {
                if self.dirs.contains_key(&d) {
                    return Err(EEXIST);
                }
                self.dirs.insert(d, BTreeMap::new());
                Ok(None)
            }
            FsOp::Rmdir(d) => match self.dirs.get(&d) {
                None => Err(ENOENT),
                Some(m) if !m.is_empty() => Err(ENOTEMPTY),
                Some(_) => {
                    self.dirs.remove(&d);
                    Ok(None)
                }
            },
            FsOp::Write(d, k, len) | FsOp::LibPut(d, k, len) => {
                let len = if matches!(op, FsOp::LibPut(..)) {
                    len.max(1)
                } else {
                    len
                };
                let Some(m) = self.dirs.get_mut(&d) else {
                    return Err(ENOENT);
                };
                if m.contains_key(&k) {
                    return Err(EEXIST);
                }
                m.insert(k, pattern(seed, len as usize));
                Ok(None)
            }
            FsOp::Read(d, k) | FsOp::LibGet(d, k) => self
                .dirs
                .get(&d)
                .and_then(|m| m.get(&k))
                .map(|v| Some(v.clone()))
                .ok_or(ENOENT),
            FsOp::Unlink(d, k) => match self.dirs.get_mut(&d).and_then(|m| m.remove(&k)) {
                Some(_) => Ok(None),
                None => Err(ENOENT),
            },
            FsOp::Rename(d, k, d2, k2) => {
                if !self.dirs.get(&d).is_some_and(|m| m.contains_key(&k))
                    || !self.dirs.contains_key(&d2)
                {
                    return Err(ENOENT);
                }
                if d == d2 && k == k2 {
                    return Ok(None);
                }
                if self.dirs[&d2].contains_key(&k2) {
                    return Err(EEXIST);
                }
                let v = self
                    .dirs
                    .get_mut(&d)
                    .expect("checked")
                    .remove(&k)
                    .expect("checked");
                self.dirs.get_mut(&d2).expect("checked").insert(k2, v);
                Ok(None)
            }
            FsOp::List(d) => match self.dirs.get(&d) {
                None => Err(ENOENT),
                Some(m) => Ok(Some(m.keys().map(|k| b'a' + k).collect())),
            },
        }
    }
}

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn lib_errno(e: maru::Error) -> i32 {
    e.errno()
}

fn real(d: &Daemon, h: &maru::Handler, root: &str, op: &FsOp, seed: u64) -> Outcome {
    let dir = |n: u8| d.path(&format!("{root}/d{n}"));
    let key = |n: u8, k: u8| d.path(&format!("{root}/d{n}/{}", (b'a' + k) as char));
    let lib = |n: u8, k: u8| format!("{root}/d{n}/{}", (b'a' + k) as char);
    match *op {
        FsOp::Mkdir(n) => std::fs::create_dir(dir(n)).map(|_| None).map_err(errno),
        FsOp::Rmdir(n) => std::fs::remove_dir(dir(n)).map(|_| None).map_err(errno),
        FsOp::Write(n, k, len) => {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(key(n, k))
                .map_err(errno)?;
            f.write_all(&pattern(seed, len as usize)).map_err(errno)?;
            drop(f);
            Ok(None)
        }
        FsOp::LibPut(n, k, len) => h
            .put(&lib(n, k), &pattern(seed, len.max(1) as usize))
            .map(|_| None)
            .map_err(lib_errno),
        FsOp::Read(n, k) => std::fs::read(key(n, k)).map(Some).map_err(errno),
        FsOp::LibGet(n, k) => match h.retrieve(&lib(n, k)) {
            Ok(Some(m)) => Ok(Some(m.to_vec())),
            Ok(None) => Err(libc::ENOENT),
            Err(e) => Err(lib_errno(e)),
        },
        FsOp::Unlink(n, k) => std::fs::remove_file(key(n, k)).map(|_| None).map_err(errno),
        FsOp::Rename(n, k, n2, k2) => std::fs::rename(key(n, k), key(n2, k2))
            .map(|_| None)
            .map_err(errno),
        FsOp::List(n) => {
            let mut names: Vec<u8> = std::fs::read_dir(dir(n))
                .map_err(errno)?
                .map(|e| e.unwrap().file_name().to_string_lossy().as_bytes()[0])
                .collect();
            names.sort();
            Ok(Some(names))
        }
    }
}

#[test]
fn mount_agrees_with_model() {
    maru_tests::require_root!();
    agrees_with_model(&[]);
}

/// The same with requests through `/dev/fuse`, as on kernels without FUSE over io_uring.
#[test]
fn mount_over_dev_fuse_agrees_with_model() {
    maru_tests::require_root!();
    agrees_with_model(&["--fuse-uring", "off"]);
}

fn agrees_with_model(extra: &[&str]) {
    use proptest::test_runner::{Config, TestRunner};
    let d = Daemon::start(Opts {
        extra: extra.iter().map(|s| s.to_string()).collect(),
        ..Opts::default()
    });
    let h = d.handler();
    let case = AtomicU32::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 24,
        max_shrink_iters: 200,
        ..Config::default()
    });
    let r = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
        let root = format!("case{}", case.fetch_add(1, Ordering::Relaxed));
        std::fs::create_dir(d.path(&root)).unwrap();
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            let seed = i as u64 + 1;
            let want = model.apply(op, seed);
            let got = real(&d, &h, &root, op, seed);
            prop_assert_eq!(&got, &want, "op {} {:?} in {:?}", i, op, ops);
        }
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}
