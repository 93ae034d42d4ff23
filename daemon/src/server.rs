//! The control server: a Unix socket speaking `maru::proto`, one task per
//! connection, caller identity from `SO_PEERCRED`.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use maru::proto::{
    self, Body, FrameReader, MAX_FDS_PER_FRAME, Op, Outcome, PROTOCOL_VERSION, Request, Response,
};
use maru::{Error, Result};
use maru_fsd::Caller;
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tracing::Instrument;

use crate::store::Store;

/// Binds the control socket (replacing a stale one) with mode 0660 and group `group`.
pub fn bind(path: &Path, gid: Option<u32>) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        // The socket's directory must be traversable by the socket's group (the daemon's
        // umask would make it 0700).
        std::fs::create_dir_all(dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another marud is listening on {}", path.display());
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid C string.
    unsafe {
        libc::chmod(c.as_ptr(), 0o660);
        if let Some(g) = gid {
            libc::chown(c.as_ptr(), u32::MAX, g);
        }
    }
    Ok(l)
}

/// Accepts connections until the listener fails.
pub async fn serve(store: Arc<Store>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let store = store.clone();
                tokio::spawn(async move {
                    let cred = stream.peer_cred().ok();
                    let caller = match cred {
                        Some(c) => Caller::with_groups(c.uid(), c.gid(), c.pid().unwrap_or(0)),
                        None => {
                            tracing::warn!("connection without peer credentials refused");
                            return;
                        }
                    };
                    let span = tracing::info_span!("conn", pid = caller.pid, uid = caller.uid);
                    Conn::new(store, stream, caller)
                        .run()
                        .instrument(span)
                        .await;
                });
            }
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// One connection's protocol state, apart from its socket: it turns request frames into
/// response bytes and descriptors (the fuzz target drives it directly).
pub struct Dispatcher {
    store: Arc<Store>,
    caller: Caller,
    session: Option<u64>,
    sent_ro: HashSet<u32>,
    sent_rw: HashSet<u32>,
    /// Encoded responses not yet sent.
    pub out: Vec<u8>,
    /// Descriptors that go with `out`, in order.
    pub out_fds: Vec<File>,
}

struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    d: Dispatcher,
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            self.store.close_session(s);
        }
    }
}

impl Conn {
    fn new(store: Arc<Store>, stream: UnixStream, caller: Caller) -> Self {
        Conn {
            stream,
            reader: FrameReader::new(),
            d: Dispatcher::new(store, caller),
        }
    }

    async fn run(mut self) {
        if let Err(e) = self.run_inner().await {
            tracing::debug!("connection closed: {e}");
        }
    }

    async fn run_inner(&mut self) -> Result<()> {
        loop {
            self.stream.readable().await?;
            let fd = self.stream.as_raw_fd();
            let r = self.stream.try_io(Interest::READABLE, || {
                // SAFETY: the stream owns fd for the duration of the call.
                let b = unsafe { BorrowedFd::borrow_raw(fd) };
                self.reader.read_from(b)
            });
            match r {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
            // Clients never send descriptors.
            if self.reader.stray_fds() > 0 {
                self.reader.drop_fds();
            }
            loop {
                let body = match self.reader.next_frame() {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(e) => {
                        // Oversized: framing is lost; say why and close.
                        self.d.push_err(0, &e);
                        self.flush().await?;
                        return Err(e);
                    }
                };
                let close = self.d.handle(&body);
                if self.d.out_fds.len() >= MAX_FDS_PER_FRAME / 2 || self.d.out.len() > (1 << 20) {
                    self.flush().await?;
                }
                if close {
                    self.flush().await?;
                    return Ok(());
                }
            }
            self.flush().await?;
        }
    }

    async fn flush(&mut self) -> Result<()> {
        let bytes = std::mem::take(&mut self.d.out);
        let fds = std::mem::take(&mut self.d.out_fds);
        let mut off = 0;
        let mut fds_sent = false;
        while off < bytes.len() {
            self.stream.writable().await?;
            let raw = self.stream.as_raw_fd();
            let borrowed: Vec<BorrowedFd<'_>> = if fds_sent {
                Vec::new()
            } else {
                fds.iter().map(|f| f.as_fd()).collect()
            };
            let r = self.stream.try_io(Interest::WRITABLE, || {
                // SAFETY: the stream owns raw for the duration of the call.
                let b = unsafe { BorrowedFd::borrow_raw(raw) };
                proto::send_some(b, &bytes[off..], &borrowed)
            });
            match r {
                Ok(n) => {
                    off += n;
                    fds_sent = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

impl Dispatcher {
    /// A new connection's state for `caller`.
    pub fn new(store: Arc<Store>, caller: Caller) -> Self {
        Dispatcher {
            store,
            caller,
            session: None,
            sent_ro: HashSet::new(),
            sent_rw: HashSet::new(),
            out: Vec::new(),
            out_fds: Vec::new(),
        }
    }

    /// Handles one frame body; true when the connection must close.
    pub fn handle(&mut self, body: &[u8]) -> bool {
        let req: Request = match proto::decode(body) {
            Ok(r) => r,
            Err(e) => {
                let id = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("id")?.as_u64())
                    .unwrap_or(0);
                self.push_err(id, &e);
                return self.session.is_none();
            }
        };
        let name = req.op.name();
        let span = tracing::debug_span!("req", id = req.id, op = name);
        let _g = span.enter();
        if self.session.is_none() && !matches!(req.op, Op::Hello { .. }) {
            self.push_err(
                req.id,
                &Error::Protocol("the first request must be hello".into()),
            );
            return true;
        }
        self.store.count(name);
        let mut fds: Vec<File> = Vec::new();
        let t = std::time::Instant::now();
        let r = self.dispatch(req.op, &mut fds);
        self.store.record_latency(name, t.elapsed());
        match r {
            Ok(b) => self.push(
                Response {
                    id: req.id,
                    fds: fds.len() as u32,
                    result: Outcome::Ok(b),
                },
                fds,
            ),
            Err(e) => {
                tracing::debug!("{name} failed: {e}");
                self.store.count("errors");
                self.push_err(req.id, &e);
            }
        }
        false
    }

    fn push(&mut self, resp: Response, fds: Vec<File>) {
        self.out.extend_from_slice(&proto::encode(&resp));
        self.out_fds.extend(fds);
    }

    /// Queues an error response.
    pub fn push_err(&mut self, id: u64, e: &Error) {
        self.push(
            Response {
                id,
                fds: 0,
                result: Outcome::Err(e.to_wire()),
            },
            Vec::new(),
        );
    }

    fn dispatch(&mut self, op: Op, fds: &mut Vec<File>) -> Result<Body> {
        let c = self.caller.clone();
        let store = self.store.clone();
        let session = self.session.unwrap_or(0);
        Ok(match op {
            Op::Hello { version, client } => {
                if self.session.is_some() {
                    return Err(Error::Protocol("hello was already sent".into()));
                }
                if version != PROTOCOL_VERSION {
                    return Err(Error::Protocol(format!(
                        "protocol {version} is not supported (this daemon speaks {PROTOCOL_VERSION})"
                    )));
                }
                let name: String = client.chars().take(64).collect();
                let s = store.open_session(&name, c);
                self.session = Some(s);
                Body::Hello {
                    version: PROTOCOL_VERSION,
                    server: format!("marud {}", env!("CARGO_PKG_VERSION")),
                    session: s,
                    pools: store.pools(),
                }
            }
            Op::Mkdir { ns, mode } => {
                store.mkdir(&c, &ns, mode)?;
                Body::Done
            }
            Op::Rmdir { ns } => {
                store.rmdir(&c, &ns)?;
                Body::Done
            }
            Op::SetQuota { ns, bytes } => {
                store.set_quota(&c, &ns, bytes)?;
                Body::Done
            }
            Op::Alloc { size, count, pool } => {
                let grants = store.alloc(session, size, count, pool.as_deref())?;
                let mut out = Vec::with_capacity(grants.len());
                for (mut g, file) in grants {
                    if let Some(f) = file {
                        fds.push(f.try_clone()?);
                    } else if self.sent_rw.insert(g.pool) {
                        fds.push(store.raw_pool_fd(g.pool, true)?);
                        g.fd = true;
                    }
                    out.push(g);
                }
                Body::Allocated { grants: out }
            }
            Op::Free { allocs } => {
                store.free(session, &allocs)?;
                Body::Done
            }
            Op::Publish {
                alloc,
                ns,
                key,
                len,
            } => Body::Published {
                generation: store.publish(session, alloc, &ns, &key, len)?,
            },
            Op::Retrieve { ns, keys } => {
                check_batch(keys.len())?;
                if keys.len() > MAX_FDS_PER_FRAME {
                    return Err(Error::InvalidArgument(format!(
                        "at most {MAX_FDS_PER_FRAME} keys per retrieve"
                    )));
                }
                let sent = &mut self.sent_ro;
                let items = store.retrieve(session, &ns, &keys, |p| !sent.insert(p))?;
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    out.push(it.map(|(loc, f)| {
                        if let Some(f) = f {
                            fds.push(f);
                        }
                        loc
                    }));
                }
                Body::Retrieved { items: out }
            }
            Op::Release { gens } => {
                check_batch(gens.len())?;
                store.release(session, &gens);
                Body::Done
            }
            Op::Exists { ns, keys } => {
                check_batch(keys.len())?;
                Body::Exists {
                    found: store.exists(&c, &ns, &keys)?,
                }
            }
            Op::Delete { ns, keys } => {
                check_batch(keys.len())?;
                Body::Batch {
                    results: batch(store.delete(&c, &ns, &keys)?),
                }
            }
            Op::Pin { ns, keys, pinned } => {
                check_batch(keys.len())?;
                Body::Batch {
                    results: batch(store.pin(&c, &ns, &keys, pinned)?),
                }
            }
            Op::Index { ns } => {
                let (f, slots) = store.index_fd(&c, &ns)?;
                fds.push(f);
                Body::Index { slots }
            }
            Op::List { ns } => {
                let (ns, children, entries) = store.list(&c, &ns)?;
                Body::Listing {
                    ns,
                    children,
                    entries,
                }
            }
            Op::Stats => Body::Stats(store.stats()),
            Op::Evict { bytes } => {
                if c.uid != 0 {
                    return Err(Error::PermissionDenied("evict is for root".into()));
                }
                let (entries, bytes) = store.evict(bytes);
                Body::Evicted { entries, bytes }
            }
        })
    }
}

fn check_batch(n: usize) -> Result<()> {
    if n > proto::MAX_BATCH {
        return Err(Error::InvalidArgument(format!(
            "batch of {n} exceeds {}",
            proto::MAX_BATCH
        )));
    }
    Ok(())
}

fn batch(v: Vec<Result<()>>) -> Vec<Option<maru::error::WireError>> {
    v.into_iter()
        .map(|r| r.err().map(|e| e.to_wire()))
        .collect()
}
