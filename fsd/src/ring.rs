//! FUSE over io_uring: one request queue per CPU, each served by a thread pinned to that CPU.
//!
//! With `/dev/fuse`, a request wakes whichever server thread waits first, usually on another
//! CPU. When that CPU sleeps (an idle vCPU halts), waking it costs 50-150 µs here, several
//! times the work of an OPEN. With io_uring (Linux 6.14+, `fuse.enable_uring`), the kernel
//! queues a request on the queue of the CPU it was made on; the thread of that queue wakes
//! on the caller's own CPU, which is awake by definition.
//!
//! fuser still mounts, answers INIT (asking for io_uring) and serves what the kernel keeps
//! sending through `/dev/fuse` (FORGET, INTERRUPT). Every other request arrives here, is
//! decoded, served by the same [`FuseFs`] logic as fuser's requests, and answered with
//! COMMIT_AND_FETCH. Protocol: the kernel's `Documentation/filesystems/fuse/fuse-io-uring.rst`
//! and `include/uapi/linux/fuse.h`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fuser::{BackingId, Errno, FopenFlags};
use io_uring::{IoUring, cqueue, opcode, squeue, types};

use crate::backend::{Attr, Backend, Kind, Upcall};
use crate::fs::Fs;
use crate::fuse::{BLKSIZE, Backing, FuseFs, Opened, XattrAnswer, caller_of, errno, xattr_answer};

/// Bytes of the payload buffer of each ring entry: the largest request (WRITE) or reply
/// (READ) the connection allows; INIT bounds max_write and max_pages to it.
pub const RING_PAYLOAD: usize = 1 << 20;
/// Ring entries per queue: one being served, one already holding the next request.
const DEPTH: usize = 2;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: in/out header, op header, `fuse_uring_ent_in_out`.
const HDR_OP: usize = 128;
const HDR_ENT: usize = 256;
const HDR_SIZE: usize = 288;
/// `fuse_in_header` (in the first 128 bytes) and `fuse_out_header` sizes. No extension
/// (`total_extlen`) is negotiated at INIT, so none follows a request's arguments.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
const _: () = assert!(IN_HEADER <= HDR_OP);

/// Where the module parameter that allows FUSE over io_uring lives.
const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// When to serve the mount over io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UringMode {
    /// Whenever the kernel can: the module parameter is turned on if it is off.
    Auto,
    /// Always; failing to set it up is an error.
    On,
    /// Never: requests go through `/dev/fuse`.
    Off,
}

impl std::str::FromStr for UringMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(UringMode::Auto),
            "on" => Ok(UringMode::On),
            "off" => Ok(UringMode::Off),
            _ => Err(format!("{s}: expected auto, on or off")),
        }
    }
}

/// Makes sure the kernel lets servers use FUSE over io_uring (turning the module parameter
/// on when it is off: it only allows servers that ask for it at INIT to use it).
pub fn allow_uring() -> std::io::Result<()> {
    match std::fs::read_to_string(ENABLE_PARAM) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => Ok(()),
        Ok(_) => {
            std::fs::write(ENABLE_PARAM, "Y")?;
            tracing::info!("turned {ENABLE_PARAM} on");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING, Linux 6.14+)",
        )),
        Err(e) => Err(e),
    }
}

/// Number of CPU ids the kernel may use (`num_possible_cpus()`): one queue each.
pub fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The highest id + 1 of a CPU list such as `0-3,8-11`.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut max = None;
    for part in s.split(',') {
        let last = part.rsplit('-').next()?.trim().parse::<usize>().ok()?;
        max = Some(max.map_or(last, |m: usize| m.max(last)));
    }
    max.map(|m| m + 1)
}

/// The queue threads of one mount.
pub struct Rings {
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Hands each thread the connection's descriptor; dropped unsent, it ends them.
    go: std::sync::mpsc::Sender<Arc<OwnedFd>>,
}

/// One ring entry's buffers, registered with the kernel; they never move.
struct Entry {
    header: Box<Header>,
    payload: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
    live: bool,
}

#[repr(C, align(64))]
struct Header([u8; HDR_SIZE]);

impl Rings {
    /// Creates one io_uring per possible CPU, each in a thread pinned to its CPU, before the
    /// mount (so that INIT only asks for io_uring when the rings exist). The threads wait for
    /// [`Rings::start`].
    pub fn prepare<B: Backend>(fs: &FuseFs<B>) -> std::io::Result<Rings> {
        let n = possible_cpus();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<Arc<OwnedFd>>();
        let go_rx = Arc::new(parking_lot::Mutex::new(go_rx));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let mut threads = Vec::with_capacity(n);
        for qid in 0..n {
            let fs = fs.share();
            let ready = ready_tx.clone();
            let go = go_rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("maru-ring{qid}"))
                    .spawn(move || {
                        crate::backend::pin_thread(qid);
                        batch_policy();
                        let ring = match new_ring() {
                            Ok(r) => {
                                let _ = ready.send(Ok(()));
                                r
                            }
                            Err(e) => {
                                let _ = ready.send(Err(e));
                                return;
                            }
                        };
                        drop(ready);
                        // Wait for the mount (or for the mount's failure: the sender drops).
                        let Ok(dev) = go.lock().recv() else { return };
                        if let Err(e) = serve_queue(&fs, ring, &dev, qid as u16) {
                            tracing::warn!(qid, "io_uring queue stopped: {e}");
                        }
                    })?,
            );
        }
        drop(ready_tx);
        for _ in 0..n {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(std::io::Error::other("an io_uring thread died")),
            }
        }
        fs.transport.want_uring.store(true, Ordering::Release);
        Ok(Rings { threads, go: go_tx })
    }

    /// Starts serving over `dev` (a descriptor of the mounted connection), after INIT
    /// (fuser's `Session::new` answers it before returning). Returns None (and ends the
    /// threads) when INIT did not agree to io_uring.
    pub fn start<B: Backend>(self, fs: &FuseFs<B>, dev: OwnedFd) -> std::io::Result<Option<Self>> {
        if !fs.transport.init_done.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the mount has not answered INIT yet"));
        }
        if !fs.transport.uring.load(Ordering::Acquire) {
            drop(self.go);
            for t in self.threads {
                let _ = t.join();
            }
            return Ok(None);
        }
        let dev = Arc::new(dev);
        for _ in &self.threads {
            let _ = self.go.send(dev.clone());
        }
        Ok(Some(self))
    }

    /// Waits (a bounded time) for the queue threads, after the unmount ended the connection.
    pub fn join(self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for t in self.threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// SCHED_BATCH: the queue thread never preempts the task that woke it. A synchronous
/// request blocks its caller, so the thread runs at once anyway; a background one (the
/// RELEASE of `close(2)`, readahead) waits until the caller blocks instead of stealing its
/// CPU in the middle of `close`.
fn batch_policy() {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread with a valid parameter.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &p) } != 0 {
        tracing::debug!("SCHED_BATCH: {}", std::io::Error::last_os_error());
    }
}

type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

fn new_ring() -> std::io::Result<Ring> {
    // Completions are only reaped by this thread, when it waits: defer the kernel's task work
    // to that moment instead of interrupting it.
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build((2 * DEPTH) as u32)
        .or_else(|_| {
            IoUring::<squeue::Entry128, cqueue::Entry>::builder().build((2 * DEPTH) as u32)
        })
}

/// A URING_CMD for `/dev/fuse`: `fuse_uring_cmd_req` in the command area; REGISTER also
/// passes the entry's two iovecs (headers, payload).
fn command(
    dev: i32,
    op: u32,
    qid: u16,
    commit_id: u64,
    entry: usize,
    iov: Option<*const libc::iovec>,
) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(dev), op).cmd(cmd);
    if let Some(p) = iov {
        b = b.addr(Some(p as u64));
    }
    let e = b.build().user_data(entry as u64);
    if iov.is_none() {
        return e;
    }
    // The builder has no field for `sqe->len` (the iovec count, 2 here): set it in place.
    // SAFETY: Entry128 is a repr(C) 128-byte SQE; `len` is the u32 at byte 24.
    unsafe {
        let mut raw: [u8; 128] = std::mem::transmute(e);
        raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(raw)
    }
}

fn push(ring: &mut Ring, e: &squeue::Entry128) -> std::io::Result<()> {
    // SAFETY: every buffer an SQE points to (the entries' iovecs, headers and payloads) lives
    // in `entries` for as long as the ring does.
    unsafe { ring.submission().push(e) }.map_err(|_| std::io::Error::other("submission queue full"))
}

/// Serves queue `qid` until the connection ends.
fn serve_queue<B: Backend>(
    fs: &FuseFs<B>,
    mut ring: Ring,
    dev: &Arc<OwnedFd>,
    qid: u16,
) -> std::io::Result<()> {
    let fd = dev.as_raw_fd();
    let mut entries: Vec<Entry> = (0..DEPTH)
        .map(|_| {
            let mut header = Box::new(Header([0; HDR_SIZE]));
            let mut payload = vec![0u8; RING_PAYLOAD];
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.0.as_mut_ptr().cast(),
                    iov_len: HDR_SIZE,
                },
                libc::iovec {
                    iov_base: payload.as_mut_ptr().cast(),
                    iov_len: RING_PAYLOAD,
                },
            ]);
            Entry {
                header,
                payload,
                iov,
                live: true,
            }
        })
        .collect();
    for (i, e) in entries.iter().enumerate() {
        push(
            &mut ring,
            &command(fd, CMD_REGISTER, qid, 0, i, Some(e.iov.as_ptr())),
        )?;
    }
    let started = Instant::now();
    // The completions of one wait (at most the CQ's size), reused from wait to wait.
    let mut done: Vec<(usize, i32)> = Vec::with_capacity(4 * DEPTH);
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
        }
        done.clear();
        done.extend(
            ring.completion()
                .map(|c| (c.user_data() as usize, c.result())),
        );
        for &(i, res) in &done {
            let Some(e) = entries.get_mut(i) else {
                continue;
            };
            if res == -libc::EAGAIN && started.elapsed() < Duration::from_secs(30) {
                // INIT not processed yet: register again.
                std::thread::sleep(Duration::from_millis(1));
                push(
                    &mut ring,
                    &command(fd, CMD_REGISTER, qid, 0, i, Some(e.iov.as_ptr())),
                )?;
                continue;
            }
            if res < 0 {
                let err = std::io::Error::from_raw_os_error(-res);
                match -res {
                    libc::ENOTCONN | libc::ECONNABORTED | libc::ENODEV => {
                        tracing::debug!(qid, "io_uring entry ended: {err}")
                    }
                    _ => tracing::warn!(qid, "io_uring entry failed: {err}"),
                }
                e.live = false;
                continue;
            }
            let unique = serve_one(fs, dev, e);
            push(
                &mut ring,
                &command(fd, CMD_COMMIT_AND_FETCH, qid, unique, i, None),
            )?;
        }
        if entries.iter().all(|e| !e.live) {
            return Ok(());
        }
    }
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_ne_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// One decoded request.
struct Req<'a> {
    opcode: u32,
    unique: u64,
    nodeid: u64,
    uid: u32,
    gid: u32,
    pid: u32,
    /// The per-op header (`in_args[0]`), zero-padded to 128 bytes.
    op: &'a [u8],
    /// The other input arguments, back to back.
    payload: &'a [u8],
}

impl Req<'_> {
    fn caller(&self, groups: bool) -> crate::backend::Caller {
        caller_of(self.uid, self.gid, self.pid, groups)
    }

    /// The `k`-th NUL-terminated string of the payload.
    fn name(&self, k: usize) -> Result<&str, Errno> {
        let s = self
            .payload
            .split(|b| *b == 0)
            .nth(k)
            .ok_or(Errno::EINVAL)?;
        std::str::from_utf8(s).map_err(|_| Errno::EINVAL)
    }
}

/// Serves the request in `e` and writes the reply into it; returns the request's unique id.
fn serve_one<B: Backend>(fs: &FuseFs<B>, dev: &Arc<OwnedFd>, e: &mut Entry) -> u64 {
    let h = &e.header.0;
    let payload_sz = (u32_at(h, HDR_ENT + 16) as usize).min(RING_PAYLOAD);
    let req = Req {
        opcode: u32_at(h, 4),
        unique: u64_at(h, 8),
        nodeid: u64_at(h, 16),
        uid: u32_at(h, 24),
        gid: u32_at(h, 28),
        pid: u32_at(h, 32),
        op: &h[HDR_OP..HDR_ENT],
        payload: &e.payload[..payload_sz],
    };
    let unique = req.unique;
    let out = dispatch(fs, dev, &req);
    let (error, len) = match out {
        Ok(bytes) => {
            let n = bytes.len().min(RING_PAYLOAD);
            e.payload[..n].copy_from_slice(&bytes[..n]);
            (0i32, n)
        }
        Err(err) => (-err.code(), 0),
    };
    let h = &mut e.header.0;
    h[0..4].copy_from_slice(&((OUT_HEADER + len) as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&error.to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    h[HDR_ENT + 16..HDR_ENT + 20].copy_from_slice(&(len as u32).to_ne_bytes());
    unique
}

/// `struct fuse_attr`.
fn put_attr(out: &mut Vec<u8>, a: &Attr) {
    let (secs, nsecs) = match a.mtime.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(_) => (0, 0),
    };
    let (kind, nlink) = match a.kind {
        Kind::Dir => (libc::S_IFDIR, 2u32),
        Kind::File => (libc::S_IFREG, 1u32),
    };
    out.extend_from_slice(&a.ino.to_ne_bytes());
    out.extend_from_slice(&a.size.to_ne_bytes());
    out.extend_from_slice(&a.size.div_ceil(512).to_ne_bytes());
    for _ in 0..3 {
        out.extend_from_slice(&secs.to_ne_bytes());
    }
    for _ in 0..3 {
        out.extend_from_slice(&nsecs.to_ne_bytes());
    }
    for v in [kind | (a.mode & 0o7777), nlink, a.uid, a.gid, 0, BLKSIZE, 0] {
        out.extend_from_slice(&v.to_ne_bytes());
    }
}

/// `struct fuse_entry_out`.
fn entry_out(a: &Attr, attr_ttl: Duration, entry_ttl: Duration) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(&a.ino.to_ne_bytes());
    out.extend_from_slice(&0u64.to_ne_bytes()); // generation
    out.extend_from_slice(&entry_ttl.as_secs().to_ne_bytes());
    out.extend_from_slice(&attr_ttl.as_secs().to_ne_bytes());
    out.extend_from_slice(&entry_ttl.subsec_nanos().to_ne_bytes());
    out.extend_from_slice(&attr_ttl.subsec_nanos().to_ne_bytes());
    put_attr(&mut out, a);
    out
}

/// `struct fuse_attr_out`.
fn attr_out(a: &Attr, ttl: Duration) -> Vec<u8> {
    let mut out = Vec::with_capacity(104);
    out.extend_from_slice(&ttl.as_secs().to_ne_bytes());
    out.extend_from_slice(&ttl.subsec_nanos().to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    put_attr(&mut out, a);
    out
}

/// `struct fuse_open_out`.
fn open_out(o: &Opened, backing_id: u32) -> Vec<u8> {
    let mut flags = o.flags;
    if o.passthrough {
        flags |= FopenFlags::FOPEN_PASSTHROUGH;
    }
    let mut out = Vec::with_capacity(16);
    out.extend_from_slice(&o.fh.to_ne_bytes());
    out.extend_from_slice(&flags.bits().to_ne_bytes());
    out.extend_from_slice(&backing_id.to_ne_bytes());
    out
}

fn empty(r: maru::Result<()>) -> Result<Vec<u8>, Errno> {
    r.map(|()| Vec::new()).map_err(|e| errno(&e))
}

/// The backing id of `ino` to put in an open reply (registered over our descriptor).
fn raw_backing<B: Backend>(fs: &FuseFs<B>, ino: u64, o: &Opened) -> Result<u32, Errno> {
    if !o.passthrough {
        return Ok(0);
    }
    if let Some(id) = o.raw_id {
        return Ok(id);
    }
    match fs.backing_of(ino, |b| match b {
        Backing::Raw { id, .. } => Some(*id),
        Backing::Fuser(_) => None,
    }) {
        Some(Some(id)) => Ok(id),
        _ => {
            fs.release_common(ino, o.fh);
            Err(Errno::EIO)
        }
    }
}

fn register(dev: &Arc<OwnedFd>) -> impl FnOnce(&std::fs::File) -> std::io::Result<Backing> + '_ {
    move |file| {
        BackingId::create_raw(dev.as_ref(), file).map(|id| Backing::Raw {
            id,
            dev: dev.clone(),
        })
    }
}

/// `struct fuse_getxattr_out` when asked for the size, else the value.
fn xattr_out(size: u32, r: maru::Result<Vec<u8>>) -> Result<Vec<u8>, Errno> {
    Ok(match xattr_answer(size, r)? {
        XattrAnswer::Size(n) => {
            let mut out = n.to_ne_bytes().to_vec();
            out.extend_from_slice(&0u32.to_ne_bytes());
            out
        }
        XattrAnswer::Data(v) => v,
    })
}

// Opcodes (include/uapi/linux/fuse.h).
const LOOKUP: u32 = 1;
const GETATTR: u32 = 3;
const SETATTR: u32 = 4;
const READLINK: u32 = 5;
const SYMLINK: u32 = 6;
const MKNOD: u32 = 8;
const MKDIR: u32 = 9;
const UNLINK: u32 = 10;
const RMDIR: u32 = 11;
const RENAME: u32 = 12;
const LINK: u32 = 13;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FSYNC: u32 = 20;
const SETXATTR: u32 = 21;
const GETXATTR: u32 = 22;
const LISTXATTR: u32 = 23;
const REMOVEXATTR: u32 = 24;
const FLUSH: u32 = 25;
const OPENDIR: u32 = 27;
const READDIR: u32 = 28;
const RELEASEDIR: u32 = 29;
const FSYNCDIR: u32 = 30;
const ACCESS: u32 = 34;
const CREATE: u32 = 35;
const DESTROY: u32 = 38;
const FALLOCATE: u32 = 43;
const RENAME2: u32 = 45;

/// `setattr` valid bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;

/// Serves one request, as fuser's adapter in [`crate::fuse`] does; the reply's output
/// arguments, back to back.
fn dispatch<B: Backend>(fs: &FuseFs<B>, dev: &Arc<OwnedFd>, r: &Req<'_>) -> Result<Vec<u8>, Errno> {
    let ino = r.nodeid;
    let f = &fs.fs;
    match r.opcode {
        LOOKUP => {
            let _span = fs.enter_pid(Upcall::Lookup, r.pid);
            let a = f
                .lookup(&r.caller(false), ino, r.name(0)?)
                .map_err(|e| errno(&e))?;
            let (attr_ttl, entry_ttl) = Fs::<B>::ttls(&a);
            Ok(entry_out(&a, attr_ttl, entry_ttl))
        }
        GETATTR => {
            let _span = fs.enter_pid(Upcall::Getattr, r.pid);
            let a = f.getattr(ino).map_err(|e| errno(&e))?;
            Ok(attr_out(&a, Fs::<B>::ttls(&a).0))
        }
        SETATTR => {
            let _span = fs.enter_pid(Upcall::Setattr, r.pid);
            let valid = u32_at(r.op, 0);
            let opt = |bit: u32, v: u32| (valid & bit != 0).then_some(v);
            let size = (valid & FATTR_SIZE != 0).then(|| u64_at(r.op, 16));
            let a = f
                .setattr(
                    &r.caller(true),
                    ino,
                    opt(FATTR_MODE, u32_at(r.op, 68)),
                    opt(FATTR_UID, u32_at(r.op, 76)),
                    opt(FATTR_GID, u32_at(r.op, 80)),
                    size,
                )
                .map_err(|e| errno(&e))?;
            Ok(attr_out(&a, Fs::<B>::ttls(&a).0))
        }
        MKDIR => {
            let _span = fs.enter_pid(Upcall::Mkdir, r.pid);
            let (mode, umask) = (u32_at(r.op, 0), u32_at(r.op, 4));
            let a = f
                .mkdir(&r.caller(true), ino, r.name(0)?, mode & !umask)
                .map_err(|e| errno(&e))?;
            let (attr_ttl, entry_ttl) = Fs::<B>::ttls(&a);
            Ok(entry_out(&a, attr_ttl, entry_ttl))
        }
        UNLINK => {
            let _span = fs.enter_pid(Upcall::Unlink, r.pid);
            empty(f.unlink(&r.caller(true), ino, r.name(0)?))
        }
        RMDIR => {
            let _span = fs.enter_pid(Upcall::Rmdir, r.pid);
            empty(f.rmdir(&r.caller(true), ino, r.name(0)?))
        }
        RENAME | RENAME2 => {
            let _span = fs.enter_pid(Upcall::Rename, r.pid);
            let newdir = u64_at(r.op, 0);
            if r.opcode == RENAME2 {
                let flags = u32_at(r.op, 8);
                if flags & (libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT) != 0 {
                    return Err(Errno::EINVAL);
                }
            }
            empty(f.rename(&r.caller(true), ino, r.name(0)?, newdir, r.name(1)?))
        }
        SYMLINK | LINK | MKNOD => Err(Errno::EPERM),
        READLINK => Err(Errno::EINVAL),
        OPEN => {
            let _span = fs.enter_pid(Upcall::Open, r.pid);
            let flags = u32_at(r.op, 0) as i32;
            let o = fs.open_common(&r.caller(false), ino, flags, register(dev))?;
            let id = raw_backing(fs, ino, &o)?;
            Ok(open_out(&o, id))
        }
        CREATE => {
            let _span = fs.enter_pid(Upcall::Create, r.pid);
            let (mode, umask) = (u32_at(r.op, 4), u32_at(r.op, 8));
            let c = r.caller(true);
            let (a, o) =
                fs.create_common(&c, ino, r.name(0)?, mode & !umask & 0o7777, register(dev))?;
            let id = raw_backing(fs, a.ino, &o)?;
            let mut out = entry_out(&a, Duration::ZERO, Duration::ZERO);
            out.extend_from_slice(&open_out(&o, id));
            Ok(out)
        }
        READ => {
            let _span = fs.enter_pid(Upcall::Read, r.pid);
            let (fh, offset, size) = (u64_at(r.op, 0), u64_at(r.op, 8), u32_at(r.op, 16));
            f.read(fh, offset, size).map_err(|e| errno(&e))
        }
        WRITE => {
            let _span = fs.enter_pid(Upcall::Write, r.pid);
            let (fh, offset, size) = (u64_at(r.op, 0), u64_at(r.op, 8), u32_at(r.op, 16));
            let data = r.payload.get(..size as usize).ok_or(Errno::EINVAL)?;
            let n = f.write(fh, offset, data).map_err(|e| errno(&e))?;
            let mut out = n.to_ne_bytes().to_vec();
            out.extend_from_slice(&0u32.to_ne_bytes());
            Ok(out)
        }
        STATFS => {
            let _span = fs.enter_pid(Upcall::Statfs, r.pid);
            let mut out = Vec::with_capacity(80);
            for v in fs.statfs_counts() {
                out.extend_from_slice(&v.to_ne_bytes());
            }
            for v in [BLKSIZE, 255, BLKSIZE, 0, 0, 0, 0, 0, 0, 0] {
                out.extend_from_slice(&v.to_ne_bytes());
            }
            Ok(out)
        }
        RELEASE => {
            let _span = fs.enter_pid(Upcall::Release, r.pid);
            fs.release_common(ino, u64_at(r.op, 0));
            Ok(Vec::new())
        }
        FLUSH => {
            let _span = fs.enter_pid(Upcall::Flush, r.pid);
            empty(f.flush(&r.caller(false), u64_at(r.op, 0)))
        }
        FSYNC | FSYNCDIR | RELEASEDIR | ACCESS | DESTROY => Ok(Vec::new()),
        OPENDIR => {
            let _span = fs.enter_pid(Upcall::Opendir, r.pid);
            match f.getattr(ino) {
                Ok(a) if a.kind == Kind::Dir => Ok(open_out(
                    &Opened {
                        fh: 0,
                        flags: FopenFlags::empty(),
                        passthrough: false,
                        raw_id: None,
                    },
                    0,
                )),
                Ok(_) => Err(Errno::ENOTDIR),
                Err(e) => Err(errno(&e)),
            }
        }
        READDIR => {
            let _span = fs.enter_pid(Upcall::Readdir, r.pid);
            let (offset, size) = (u64_at(r.op, 8), u32_at(r.op, 16) as usize);
            let list = f.readdir(&r.caller(true), ino).map_err(|e| errno(&e))?;
            let mut out = Vec::new();
            for (i, e) in list.iter().enumerate().skip(offset as usize) {
                let name = e.name.as_bytes();
                let rec = (24 + name.len()).next_multiple_of(8);
                if out.len() + rec > size.min(RING_PAYLOAD) {
                    break;
                }
                let kind = match e.kind {
                    Kind::Dir => libc::DT_DIR,
                    Kind::File => libc::DT_REG,
                };
                out.extend_from_slice(&e.ino.to_ne_bytes());
                out.extend_from_slice(&((i + 1) as u64).to_ne_bytes());
                out.extend_from_slice(&(name.len() as u32).to_ne_bytes());
                out.extend_from_slice(&u32::from(kind).to_ne_bytes());
                out.extend_from_slice(name);
                out.resize(out.len().next_multiple_of(8), 0);
            }
            Ok(out)
        }
        SETXATTR => {
            let _span = fs.enter_pid(Upcall::Setxattr, r.pid);
            let size = u32_at(r.op, 0) as usize;
            let name = r.name(0)?;
            let value = r
                .payload
                .get(name.len() + 1..name.len() + 1 + size)
                .ok_or(Errno::EINVAL)?;
            empty(f.setxattr(&r.caller(true), ino, name, value))
        }
        GETXATTR => {
            let _span = fs.enter_pid(Upcall::Getxattr, r.pid);
            xattr_out(u32_at(r.op, 0), f.getxattr(ino, r.name(0)?))
        }
        LISTXATTR => {
            let _span = fs.enter_pid(Upcall::Listxattr, r.pid);
            xattr_out(u32_at(r.op, 0), f.listxattr(ino))
        }
        REMOVEXATTR => {
            let _span = fs.enter_pid(Upcall::Removexattr, r.pid);
            empty(f.setxattr(&r.caller(true), ino, r.name(0)?, b"0"))
        }
        FALLOCATE => {
            let _span = fs.enter_pid(Upcall::Fallocate, r.pid);
            let (fh, offset, length) = (u64_at(r.op, 0), u64_at(r.op, 8), u64_at(r.op, 16));
            let mode = u32_at(r.op, 24) as i32;
            empty(f.fallocate(fh, offset, length, mode))
        }
        _ => Err(Errno::ENOSYS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0-3,8-11"), Some(12));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn attr_layouts_match_the_kernel() {
        let a = Attr {
            ino: 7,
            kind: Kind::File,
            size: 4096,
            mode: 0o640,
            uid: 1,
            gid: 2,
            mtime: std::time::UNIX_EPOCH + Duration::new(5, 6),
            sealed: true,
        };
        // fuse_entry_out is 40 + 88 bytes, fuse_attr_out 16 + 88.
        assert_eq!(entry_out(&a, Duration::ZERO, Duration::ZERO).len(), 128);
        let out = attr_out(&a, Duration::from_millis(1500));
        assert_eq!(out.len(), 104);
        assert_eq!(u64_at(&out, 0), 1);
        assert_eq!(u32_at(&out, 8), 500_000_000);
        assert_eq!(u64_at(&out, 16), 7); // ino
        assert_eq!(u64_at(&out, 16 + 24), 5); // atime
        assert_eq!(u32_at(&out, 16 + 48), 6); // atimensec
        assert_eq!(u32_at(&out, 16 + 60), libc::S_IFREG | 0o640); // mode
    }
}
