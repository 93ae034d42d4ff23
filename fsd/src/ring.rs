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
//! decoded into a [`crate::server::Request`] ([`crate::codec`]), served by the same
//! [`Server::dispatch`] as fuser's requests, and its [`Reply`] encoded into the entry and
//! committed with COMMIT_AND_FETCH. Protocol: the kernel's
//! `Documentation/filesystems/fuse/fuse-io-uring.rst` and `include/uapi/linux/fuse.h`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use maru::host::FUSE_URING_PARAM;

use crate::abi::{self, Plain};
use crate::backend::Backend;
use crate::codec::{decode, encode};
pub use crate::server::RING_PAYLOAD;
use crate::server::{Ids, Registrar, Reply, Server};

/// Ring entries per queue: one being served, one already holding the next request.
const DEPTH: usize = 2;

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
    match maru::host::fuse_uring_param()? {
        Some(true) => Ok(()),
        Some(false) => {
            std::fs::write(FUSE_URING_PARAM, "Y")?;
            tracing::info!("turned {FUSE_URING_PARAM} on");
            Ok(())
        }
        None => Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING, Linux 6.14+)",
        )),
    }
}

/// Number of CPU ids the kernel may use (`num_possible_cpus()`): one queue each.
pub fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| highest_cpu(&s))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The highest id + 1 of a CPU list such as `0-3,8-11`.
fn highest_cpu(list: &str) -> Option<usize> {
    let ranges = maru::host::parse_cpu_list(list)?;
    ranges.iter().map(|&(_, last)| last as usize + 1).max()
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
struct Header(abi::UringReqHeader);

impl Rings {
    /// Creates one io_uring per possible CPU, each in a thread pinned to its CPU, before the
    /// mount (so that INIT only asks for io_uring when the rings exist). The threads wait for
    /// [`Rings::start`].
    pub fn prepare<B: Backend>(fs: &Server<B>) -> std::io::Result<Rings> {
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
                        // `ready` fails only when `prepare` gave up (another thread failed):
                        // this one then ends too.
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
        fs.transport().want_uring.store(true, Ordering::Release);
        Ok(Rings { threads, go: go_tx })
    }

    /// Starts serving over `dev` (a descriptor of the mounted connection), after INIT
    /// (fuser's `Session::new` answers it before returning). Returns None (and ends the
    /// threads) when INIT did not agree to io_uring.
    pub fn start<B: Backend>(self, fs: &Server<B>, dev: OwnedFd) -> std::io::Result<Option<Self>> {
        if !fs.transport().init_done.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the mount has not answered INIT yet"));
        }
        if !fs.transport().uring.load(Ordering::Acquire) {
            drop(self.go);
            for t in self.threads {
                // A queue thread that panicked has nothing left to clean up.
                let _ = t.join();
            }
            return Ok(None);
        }
        let dev = Arc::new(dev);
        for _ in &self.threads {
            // A thread that already ended (its ring failed, logged there) takes no descriptor.
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
                // A queue thread that panicked has nothing left to clean up.
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
    // nix has no sched_setscheduler. A failure only costs the preemption described above.
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
    let req = abi::UringCmdReq {
        flags: 0,
        commit_id,
        qid,
        padding: [0; 6],
    };
    let mut cmd = [0u8; 80];
    cmd[..size_of::<abi::UringCmdReq>()].copy_from_slice(req.as_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(dev), op).cmd(cmd);
    if let Some(p) = iov {
        b = b.addr(Some(p as u64));
    }
    let e = b.build().user_data(entry as u64);
    match iov {
        Some(_) => with_len(e, abi::URING_IOV_SEGS),
        None => e,
    }
}

/// `e` with its `sqe->len` set to `len`: the io-uring crate's URING_CMD builder has no setter
/// for it, and REGISTER passes its iovec count there.
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(size_of::<squeue::Entry128>() == size_of::<abi::Sqe128>());
    // SAFETY: Entry128 is #[repr(C)]: the kernel's 64-byte `io_uring_sqe` (integers and unions
    // of integers, no padding) then 64 bytes; abi::Sqe128 mirrors the same 128 bytes with
    // integers only. Any initialized bytes are a valid value of either.
    let mut sqe = unsafe { std::mem::transmute::<squeue::Entry128, abi::Sqe128>(e) };
    sqe.head.len = len;
    // SAFETY: as above, the other way.
    unsafe { std::mem::transmute::<abi::Sqe128, squeue::Entry128>(sqe) }
}

fn push(ring: &mut Ring, e: &squeue::Entry128) -> std::io::Result<()> {
    // SAFETY: every buffer an SQE points to (the entries' iovecs, headers and payloads) lives
    // in `entries` for as long as the ring does.
    unsafe { ring.submission().push(e) }.map_err(|_| std::io::Error::other("submission queue full"))
}

/// Serves queue `qid` until the connection ends.
fn serve_queue<B: Backend>(
    fs: &Server<B>,
    mut ring: Ring,
    dev: &Arc<OwnedFd>,
    qid: u16,
) -> std::io::Result<()> {
    let fd = dev.as_raw_fd();
    let mut entries: Vec<Entry> = (0..DEPTH)
        .map(|_| {
            let mut header = Box::new(Header(abi::UringReqHeader::default()));
            let mut payload = vec![0u8; RING_PAYLOAD];
            let iov = Box::new([
                libc::iovec {
                    iov_base: (&raw mut header.0).cast(),
                    iov_len: size_of::<abi::UringReqHeader>(),
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
        let register = abi::FUSE_IO_URING_CMD_REGISTER;
        push(
            &mut ring,
            &command(fd, register, qid, 0, i, Some(e.iov.as_ptr())),
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
                let register = abi::FUSE_IO_URING_CMD_REGISTER;
                push(
                    &mut ring,
                    &command(fd, register, qid, 0, i, Some(e.iov.as_ptr())),
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
            let unique = serve_one(fs, dev, &mut e.header.0, &mut e.payload);
            let commit = abi::FUSE_IO_URING_CMD_COMMIT_AND_FETCH;
            push(&mut ring, &command(fd, commit, qid, unique, i, None))?;
        }
        if entries.iter().all(|e| !e.live) {
            return Ok(());
        }
    }
}

/// Serves the request in a ring entry (`header`, `payload`) and writes the reply into it;
/// returns the request's unique id.
fn serve_one<B: Backend>(
    fs: &Server<B>,
    dev: &Arc<OwnedFd>,
    header: &mut abi::UringReqHeader,
    payload: &mut [u8],
) -> u64 {
    // Always there: the in/out area is larger than the header (checked in abi).
    let h = abi::InHeader::read_from(&header.in_out).unwrap_or_default();
    let len = (header.ring_ent_in_out.payload_sz as usize).min(payload.len());
    let ids = Ids {
        uid: h.uid,
        gid: h.gid,
        pid: h.pid,
    };
    let reply = match decode(&h, &header.op_in, &payload[..len]) {
        Ok(req) => fs.dispatch(&req, ids, Registrar::Raw(dev)),
        Err(e) => Reply::Err(e),
    };
    let (error, len) = match encode(&reply, payload) {
        Ok(n) => (0, n),
        Err(e) => {
            // A handle the kernel will never hear of.
            match &reply {
                Reply::Open(o) => fs.withdraw(o.fh, false),
                Reply::Created { opened: o, .. } => fs.withdraw(o.fh, true),
                _ => {}
            }
            (-e.code(), 0)
        }
    };
    let out = abi::OutHeader {
        len: (size_of::<abi::OutHeader>() + len) as u32,
        error,
        unique: h.unique,
    };
    header.in_out[..size_of::<abi::OutHeader>()].copy_from_slice(out.as_bytes());
    header.ring_ent_in_out.payload_sz = len as u32;
    h.unique
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::OpenedFile;
    use crate::fs::Fs;
    use crate::testing::{Call, Rec};
    use fuser::FopenFlags;

    fn header(opcode: u32, nodeid: u64) -> abi::InHeader {
        abi::InHeader {
            len: 0,
            opcode,
            unique: 42,
            nodeid,
            uid: 1000,
            gid: 100,
            pid: std::process::id(),
            total_extlen: 0,
            padding: 0,
        }
    }

    /// A zero-filled op area holding `arg`.
    fn op_area(arg: &impl Plain) -> [u8; abi::URING_OP_IN_OUT_SZ] {
        let mut op = [0; abi::URING_OP_IN_OUT_SZ];
        arg.write_to(&mut op).unwrap();
        op
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(highest_cpu("0"), Some(1));
        assert_eq!(highest_cpu("0-1\n"), Some(2));
        assert_eq!(highest_cpu("0-3,8-11"), Some(12));
        assert_eq!(highest_cpu("x"), None);
        assert_eq!(highest_cpu(""), None);
    }

    #[test]
    fn register_commands_carry_their_iovec_count() {
        let iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let register = abi::FUSE_IO_URING_CMD_REGISTER;
        let e = command(5, register, 3, 0, 1, Some(iov.as_ptr()));
        // SAFETY: as in `with_len`: both are 128 bytes of integers.
        let sqe = unsafe { std::mem::transmute::<squeue::Entry128, abi::Sqe128>(e) };
        assert_eq!(sqe.head.len, abi::URING_IOV_SEGS);
        assert_eq!(sqe.head.addr, iov.as_ptr() as u64);
        assert_eq!((sqe.head.fd, sqe.head.user_data), (5, 1));
        assert_eq!(sqe.head.off as u32, register); // cmd_op
        // The command area starts at byte 48 of the SQE.
        let cmd = abi::UringCmdReq::read_from(&sqe.rest[48 - size_of::<abi::SqeHead>()..]);
        assert_eq!(cmd.map(|c| (c.qid, c.commit_id)), Some((3, 0)));

        let commit = abi::FUSE_IO_URING_CMD_COMMIT_AND_FETCH;
        let e = command(5, commit, 3, 77, 0, None);
        // SAFETY: as above.
        let sqe = unsafe { std::mem::transmute::<squeue::Entry128, abi::Sqe128>(e) };
        assert_eq!((sqe.head.len, sqe.head.addr), (0, 0));
        let cmd = abi::UringCmdReq::read_from(&sqe.rest[8..]);
        assert_eq!(cmd.map(|c| (c.qid, c.commit_id)), Some((3, 77)));
    }

    /// Serves one request through a ring entry: (out header, reply payload).
    fn serve(
        fs: &Server<Rec>,
        h: abi::InHeader,
        op: [u8; abi::URING_OP_IN_OUT_SZ],
        payload: &[u8],
    ) -> (abi::OutHeader, Vec<u8>) {
        let dev = Arc::new(OwnedFd::from(std::fs::File::open("/dev/null").unwrap()));
        let mut header = abi::UringReqHeader::default();
        h.write_to(&mut header.in_out).unwrap();
        header.op_in = op;
        header.ring_ent_in_out.payload_sz = payload.len() as u32;
        let mut buf = vec![0u8; 4096];
        buf[..payload.len()].copy_from_slice(payload);
        assert_eq!(serve_one(fs, &dev, &mut header, &mut buf), 42);
        let out = abi::OutHeader::read_from(&header.in_out).unwrap();
        let n = header.ring_ent_in_out.payload_sz as usize;
        assert_eq!(out.len as usize, size_of::<abi::OutHeader>() + n);
        (out, buf[..n].to_vec())
    }

    #[test]
    fn a_writer_is_served_through_the_ring() {
        let fs = Server::new(Fs::new(Rec::serving(OpenedFile::Writing(None))));
        let create = abi::CreateIn {
            flags: libc::O_WRONLY as u32,
            mode: 0o644,
            umask: 0o022,
            open_flags: 0,
        };
        let h = header(abi::FUSE_CREATE, 1);
        let (out, reply) = serve(&fs, h, op_area(&create), b"k\0");
        assert_eq!((out.error, out.unique, reply.len()), (0, 42, 144));
        let o = abi::OpenOut::read_from(&reply[128..]).unwrap();
        let direct_io = FopenFlags::FOPEN_DIRECT_IO.bits();
        assert_eq!((o.open_flags, o.backing_id), (direct_io, 0));

        let w = abi::WriteIn {
            fh: o.fh,
            size: 3,
            write_flags: abi::FUSE_WRITE_CACHE,
            ..Default::default()
        };
        let (out, reply) = serve(&fs, header(abi::FUSE_WRITE, 7), op_area(&w), b"abc");
        assert_eq!(out.error, 0);
        assert_eq!(abi::WriteOut::read_from(&reply).map(|w| w.size), Some(3));

        let f = abi::FlushIn {
            fh: o.fh,
            ..Default::default()
        };
        fs.fs().backend().fail_commits(libc::EDQUOT);
        let (out, reply) = serve(&fs, header(abi::FUSE_FLUSH, 7), op_area(&f), &[]);
        assert_eq!((out.error, reply.len()), (-libc::EDQUOT, 0));

        let a = abi::FallocateIn {
            fh: o.fh,
            offset: 0,
            length: 1 << 20,
            ..Default::default()
        };
        let (out, _) = serve(&fs, header(abi::FUSE_FALLOCATE, 7), op_area(&a), &[]);
        assert_eq!(out.error, 0);
        assert!(fs.fs().backend().calls().contains(&Call::Fallocate {
            ino: 7,
            offset: 0,
            len: 1 << 20
        }));
    }
}
