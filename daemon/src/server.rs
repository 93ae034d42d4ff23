//! The control server: a Unix socket speaking `maru::proto`, caller identity from
//! `SO_PEERCRED`.
//!
//! The accept loop is a tokio task (it never blocks); each connection is served on a thread
//! of its own with blocking I/O, because serving a request blocks: the store's mutex,
//! `/proc` reads for the caller's groups (up to 50 ms), waits of up to 1 s in `exists` and
//! `retrieve` for an entry being published. On a tokio worker any of these would stall every
//! other connection (and the metrics server) scheduled there.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use maru::lane::{LANE_CAP, Lane, NUDGE};
use maru::proto::{
    self, Body, FrameReader, Located, MAX_FDS_PER_FRAME, NsInfo, Op, Outcome, PROTOCOL_VERSION,
    Request, Response,
};
use maru::{Error, Result};
use maru_fsd::Caller;
use tokio::net::UnixListener;

use crate::store::{SessionId, Store};

/// The group the control socket is given (with mode 0660), so that its members may connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketGroup {
    /// Group id.
    pub gid: u32,
    /// Asked for by name (`--group`): failing to give the socket to it fails the start. The
    /// default group (`maru`, where it exists) is given the socket where the daemon may.
    pub explicit: bool,
}

/// Decodes a frame body; for one that is not a request, its id (if it has one) and why.
fn decode(body: &[u8]) -> std::result::Result<Request, (u64, Error)> {
    proto::decode(body).map_err(|e| {
        let id = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("id")?.as_u64())
            .unwrap_or(0);
        (id, e)
    })
}

/// Binds the control socket (replacing a stale one) with mode 0660 and group `group`.
pub fn bind(path: &Path, group: Option<SocketGroup>) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        // The socket's directory must be traversable by the socket's group (the daemon's
        // umask would make it 0700).
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} traversable", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            anyhow::bail!("another marud is listening on {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    // std covers both calls (no libc, no nix needed).
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    if let Some(g) = group
        && let Err(e) = std::os::unix::fs::chown(path, None, Some(g.gid))
    {
        if g.explicit {
            return Err(e).with_context(|| format!("giving {} to group {}", path.display(), g.gid));
        }
        // Only the daemon's user can connect then; the daemon itself works.
        tracing::warn!(
            socket = %path.display(),
            gid = g.gid,
            "cannot give the socket to the default group: {e}"
        );
    }
    Ok(l)
}

/// Accepts connections until the task is dropped; each is served on its own thread, at most
/// `max` at once. One more has its first request (the hello) answered `Busy` and is closed,
/// or closed without an answer when its client sends nothing within [`REFUSAL_WAIT`]; past
/// [`REFUSING`] such connections at once, the next ones are closed at the accept.
pub async fn serve(store: Arc<Store>, listener: UnixListener, max: usize) {
    let live = Arc::new(AtomicUsize::new(0));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let slot = Slot::take(&live);
                if slot.0 >= max + REFUSING {
                    store.count("connections_refused");
                    continue;
                }
                let full = (slot.0 >= max).then_some(max);
                if let Err(e) = spawn_conn(store.clone(), stream, slot, full) {
                    // The stream was dropped: the client sees the connection closed.
                    tracing::warn!("connection refused: cannot start its thread: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Connections over the cap being answered at once, past which more are closed unanswered.
const REFUSING: usize = 64;
/// How long a connection over the cap is given to send its hello.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// One connection counted among those served (with the count before it): let go when the
/// connection ends.
struct Slot(usize, Arc<AtomicUsize>);

impl Slot {
    fn take(live: &Arc<AtomicUsize>) -> Slot {
        Slot(live.fetch_add(1, Ordering::AcqRel), live.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `stream` on a thread of its own; `full` (the cap) when it is over the cap.
fn spawn_conn(
    store: Arc<Store>,
    stream: tokio::net::UnixStream,
    slot: Slot,
    full: Option<usize>,
) -> std::io::Result<()> {
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    if full.is_some() {
        store.count("connections_refused");
        stream.set_read_timeout(Some(REFUSAL_WAIT))?;
    }
    std::thread::Builder::new()
        .name("marud-conn".into())
        .spawn(move || {
            serve_conn(store, stream, full);
            drop(slot);
        })?;
    Ok(())
}

/// Serves one connection until the peer closes it or breaks the protocol (answers its first
/// request `Busy`, then closes it, when it is over the cap `full`).
fn serve_conn(store: Arc<Store>, stream: UnixStream, full: Option<usize>) {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = match getsockopt(&stream, PeerCredentials) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("connection without peer credentials refused: {e}");
            return;
        }
    };
    let caller = Caller::with_groups(cred.uid(), cred.gid(), cred.pid());
    let span = tracing::info_span!("conn", pid = caller.pid, uid = caller.uid);
    let _g = span.enter();
    let mut conn = Conn {
        stream,
        reader: FrameReader::new(),
        d: Dispatcher::new(store, caller),
        gap: Duration::ZERO,
    };
    conn.d.full = full;
    if let Err(e) = conn.run() {
        tracing::debug!("connection closed: {e}");
    }
}

/// One connection's protocol state, apart from its socket: it turns request frames into
/// response bytes and descriptors (the fuzz target drives it directly).
pub struct Dispatcher {
    store: Arc<Store>,
    caller: Caller,
    session: Option<SessionId>,
    sent_ro: HashSet<u32>,
    sent_rw: HashSet<u32>,
    /// Encoded responses not yet sent.
    pub out: Vec<u8>,
    /// Descriptors that go with `out`, in order.
    pub out_fds: Vec<File>,
    /// `out` holds a reply to send at once rather than with the next frames' replies.
    pub urgent: bool,
    /// The connection's shared-memory lane, once the client asked for one (`Op::Lane`).
    pub lane: Option<Lane>,
    /// Publications read and not handled yet, as (request id, allocation, namespace, key,
    /// length): handled together with those that follow them ([`Dispatcher::publish_all`]).
    publishes: Vec<(u64, u64, String, String, Option<u64>)>,
    /// The cap on connections, when this one is over it: its first request is answered
    /// `Busy`, and it is closed.
    full: Option<usize>,
}

/// How long a connection's thread polls for the next request after answering one, when
/// the client's last request came later than [`LOOP_SPIN`] after its reply.
const SPIN: Duration = Duration::from_micros(30);
/// ... and when it came sooner: the client is in a loop of calls. A client that waited
/// longer than its own poll (`MARU_SPIN_US`) sleeps, and a virtual CPU takes 50–150 µs to
/// wake it; polling for longer than that keeps this thread from sleeping in turn, so that
/// one slow call does not leave both sides waking each other for the calls that follow.
const LOOP_SPIN: Duration = Duration::from_micros(200);

struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    d: Dispatcher,
    /// How long after its reply the client's last request came.
    gap: Duration,
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            self.store.close_session(s);
        }
    }
}

impl Conn {
    /// Reads, handles and answers frames (and the lane's requests) until the peer closes the
    /// connection.
    fn run(&mut self) -> Result<()> {
        loop {
            match self.read_next() {
                Ok(false) => return Ok(()),
                Ok(true) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
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
                        self.d.publish_all();
                        self.d.push_err(0, &e);
                        self.flush()?;
                        return Err(e);
                    }
                };
                let req = match decode(&body) {
                    // A publication waits for those that follow it.
                    Ok(r) => match self.d.defer_publish(r) {
                        Some(r) => Ok(r),
                        None => continue,
                    },
                    Err(e) => Err(e),
                };
                // The publications before this request are answered first.
                self.d.publish_all();
                let before = (self.d.out.len(), self.d.out_fds.len());
                let close = match req {
                    Ok(r) => self.d.handle_request(r),
                    Err((id, e)) => self.d.refuse(id, &e),
                };
                if self.d.out_fds.len() > MAX_FDS_PER_FRAME {
                    // One sendmsg carries at most MAX_FDS_PER_FRAME descriptors, and one
                    // response at most that many: what was queued before goes first.
                    self.flush_split(before)?;
                } else if self.d.out_fds.len() >= MAX_FDS_PER_FRAME / 2
                    || self.d.out.len() > (1 << 20)
                    || std::mem::take(&mut self.d.urgent)
                {
                    self.flush()?;
                }
                if close {
                    self.flush()?;
                    return Ok(());
                }
            }
            // Everything the frames of this read asked for, in one send.
            self.d.publish_all();
            self.flush()?;
            if self.serve_lane()? {
                return Ok(());
            }
        }
    }

    /// Handles the request in the lane, if there is one, and answers in the lane when the
    /// reply fits and carries no descriptor (on the socket otherwise). True when the
    /// connection must close.
    fn serve_lane(&mut self) -> Result<bool> {
        let Some(req) = self.d.lane.as_mut().and_then(Lane::take_request) else {
            return Ok(false);
        };
        let (id, body) = match req {
            Ok(r) => r,
            Err(e) => {
                self.d.push_err(0, &e);
                self.flush()?;
                return Err(e);
            }
        };
        self.d.store.count("lane_requests");
        let close = self.d.handle(&body);
        self.d.urgent = false;
        let fits = self.d.out.len() <= 4 + LANE_CAP;
        if let Some(lane) = self
            .d
            .lane
            .as_ref()
            .filter(|_| fits && self.d.out_fds.is_empty())
        {
            // One response, framed: the lane takes its body.
            let out = std::mem::take(&mut self.d.out);
            if lane.post_reply(id, &out[4..]) {
                proto::send_all(self.stream.as_fd(), &NUDGE, &[])?;
            }
        } else {
            self.flush()?;
            if let Some(lane) = &self.d.lane {
                lane.replied_on_socket(id);
            }
        }
        Ok(close)
    }

    /// Waits for the next frames or a request in the lane; false once the peer closed. A
    /// client in a loop of calls sends its next request within microseconds of a reply, so
    /// the thread polls ([`SPIN`], or [`LOOP_SPIN`] while the client's requests follow their
    /// replies closely), yielding the CPU to any other runnable thread between polls, before
    /// it sleeps on the socket: waking a sleeping thread costs more than the request itself
    /// on virtual machines, and an idle client costs at most one short poll per request. A
    /// client that posts in the lane while this thread sleeps nudges it.
    fn read_next(&mut self) -> std::io::Result<bool> {
        let t0 = Instant::now();
        let spin = if self.gap <= LOOP_SPIN {
            LOOP_SPIN
        } else {
            SPIN
        };
        let r = self.poll(t0, spin);
        self.gap = t0.elapsed();
        r
    }

    fn poll(&mut self, t0: Instant, spin: Duration) -> std::io::Result<bool> {
        let mut polls = 0u32;
        loop {
            if self.d.lane.as_ref().is_some_and(Lane::has_request) {
                return Ok(true);
            }
            // The socket, a system call, is looked at every few polls only while the lane,
            // a load, is in use: it carries only pipelined requests and nudges then.
            if self.d.lane.is_none() || polls.is_multiple_of(4) {
                match self.reader.try_read_from(self.stream.as_fd()) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    r => return r.map(|n| n > 0),
                }
                if t0.elapsed() >= spin {
                    break;
                }
            }
            polls = polls.wrapping_add(1);
            std::thread::yield_now();
        }
        if let Some(lane) = &self.d.lane
            && lane.server_asleep(true)
        {
            lane.server_asleep(false);
            return Ok(true);
        }
        let r = self.reader.read_from(self.stream.as_fd());
        if let Some(lane) = &self.d.lane {
            lane.server_asleep(false);
        }
        r.map(|n| n > 0)
    }

    /// Sends the queued responses and their descriptors (blocking).
    fn flush(&mut self) -> Result<()> {
        self.flush_split((0, 0))
    }

    /// [`Conn::flush`] in two sends: the first `at.0` bytes with the first `at.1` descriptors,
    /// then the rest. A response's descriptors travel with (or before) its bytes, so that the
    /// client has them when it parses the response.
    fn flush_split(&mut self, at: (usize, usize)) -> Result<()> {
        let bytes = std::mem::take(&mut self.d.out);
        let fds = std::mem::take(&mut self.d.out_fds);
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        for (b, f) in [
            (&bytes[..at.0], &borrowed[..at.1]),
            (&bytes[at.0..], &borrowed[at.1..]),
        ] {
            if !b.is_empty() {
                proto::send_all(self.stream.as_fd(), b, f)?;
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
            urgent: false,
            lane: None,
            publishes: Vec::new(),
            full: None,
        }
    }

    /// Handles one frame body; true when the connection must close.
    pub fn handle(&mut self, body: &[u8]) -> bool {
        match decode(body) {
            Ok(req) => self.handle_request(req),
            Err((id, e)) => self.refuse(id, &e),
        }
    }

    /// Answers a frame that is not a request; true when the connection must close (no
    /// session yet).
    fn refuse(&mut self, id: u64, e: &Error) -> bool {
        self.push_err(id, e);
        self.session.is_none()
    }

    /// Takes `req` to be handled with the publications that follow it, if it is a
    /// publication (see [`Dispatcher::publish_all`]); gives it back otherwise.
    fn defer_publish(&mut self, req: Request) -> Option<Request> {
        match req.op {
            Op::Publish {
                alloc,
                ns,
                key,
                len,
            } if self.session.is_some() => {
                self.publishes.push((req.id, alloc, ns, key, len));
                None
            }
            _ => Some(req),
        }
    }

    /// Handles the deferred publications together, answering each: publications that follow
    /// one another (a client's batch store, pipelined) are asked of the store's authority at
    /// once (in cluster mode, one group commit).
    fn publish_all(&mut self) {
        if self.publishes.is_empty() {
            return;
        }
        let items: Vec<_> = self
            .publishes
            .iter()
            .map(
                |(_, alloc, ns, key, len)| crate::store::publishing::Publish {
                    id: *alloc,
                    ns,
                    key,
                    len: *len,
                },
            )
            .collect();
        let t = std::time::Instant::now();
        let session = self
            .session
            .expect("publications are deferred once a session is open");
        crate::store::take_sync_failure();
        let outcomes = self.store.publish_many(session, &items);
        // Records of theirs that could not be synced: none of them is a success.
        let unsynced = crate::store::take_sync_failure();
        let each = t.elapsed() / items.len() as u32;
        drop(items);
        for ((id, ..), r) in std::mem::take(&mut self.publishes)
            .into_iter()
            .zip(outcomes)
        {
            self.store.count("publish");
            self.store.record_latency("publish", each);
            match (r, &unsynced) {
                (Ok(generation), None) => self.push(
                    Response {
                        id,
                        fds: 0,
                        result: Outcome::Ok(Body::Published { generation }),
                    },
                    Vec::new(),
                ),
                (Ok(_), Some(e)) => {
                    self.store.count("errors");
                    self.push_err(id, e);
                }
                (Err(e), _) => {
                    tracing::debug!("publish failed: {e}");
                    self.store.count("errors");
                    self.push_err(id, &e);
                }
            }
        }
    }

    /// Handles one request; true when the connection must close.
    fn handle_request(&mut self, req: Request) -> bool {
        let name = req.op.name();
        let span = tracing::debug_span!("req", id = req.id, op = name);
        let _g = span.enter();
        if let Some(max) = self.full {
            tracing::warn!(
                max,
                "connection refused: marud serves {max} connections already"
            );
            let why = format!(
                "marud serves {max} connections already (--max-connections); try again once \
                 others have closed"
            );
            self.push_err(req.id, &Error::Busy(why));
            return true;
        }
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
        crate::store::take_sync_failure();
        let r = self.dispatch(req.op, &mut fds);
        self.store.record_latency(name, t.elapsed());
        // A record of the verb's that could not be synced: not a success.
        let r = match crate::store::take_sync_failure() {
            Some(e) if r.is_ok() => {
                fds.clear();
                Err(e)
            }
            _ => r,
        };
        // The client maps what a retrieval names while the next request is handled.
        self.urgent |= matches!(r, Ok(Body::Retrieved { .. }));
        // A raw pool's read-write descriptor an allocation's answer carries: the connection
        // holds it from now on (a memfs grant's file is its own, whatever this notes).
        if let Ok(Body::Allocated { grants }) = &r {
            self.sent_rw
                .extend(grants.iter().filter(|g| g.fd).map(|g| g.pool));
        }
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
        // Every verb but hello needs the session hello opened (`handle` refuses them before).
        let opened = self.session;
        let session = move || opened.ok_or_else(|| Error::Protocol("no hello yet".into()));
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
                    session: s.get(),
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
            Op::Alloc {
                size,
                count,
                pool,
                ns,
            } => {
                let grants =
                    store.alloc(session()?, size, count, pool.as_deref(), ns.as_deref())?;
                let mut out = Vec::with_capacity(grants.len());
                // A grant in the same file (a pack) as the one before it goes without one.
                let mut last: Option<std::sync::Arc<std::fs::File>> = None;
                for (mut g, file) in grants {
                    if let Some(f) = file {
                        if last.as_ref().is_some_and(|l| std::sync::Arc::ptr_eq(l, &f)) {
                            g.fd = false;
                        } else {
                            fds.push(f.try_clone()?);
                            last = Some(f);
                        }
                    } else if !self.sent_rw.contains(&g.pool)
                        && !out
                            .iter()
                            .any(|o: &maru::proto::Grant| o.fd && o.pool == g.pool)
                    {
                        // Noted as held once the answer goes (`handle_request`).
                        fds.push(store.raw_pool_fd(g.pool, true)?);
                        g.fd = true;
                    }
                    out.push(g);
                }
                Body::Allocated { grants: out }
            }
            Op::Free { allocs } => {
                store.free(session()?, &allocs)?;
                Body::Done
            }
            Op::Publish {
                alloc,
                ns,
                key,
                len,
            } => Body::Published {
                generation: store.publish(session()?, alloc, &ns, &key, len)?,
            },
            Op::Retrieve { ns, keys } => {
                check_batch(keys.len())?;
                if keys.len() > MAX_FDS_PER_FRAME {
                    return Err(Error::InvalidArgument(format!(
                        "at most {MAX_FDS_PER_FRAME} keys per retrieve"
                    )));
                }
                let sent = &mut self.sent_ro;
                let items = store.retrieve(session()?, &ns, &keys, |p| sent.contains(&p))?;
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    out.push(it.map(|(loc, f)| {
                        if let Some(f) = f {
                            // A raw pool's descriptor: the connection holds it from now on.
                            if maru::index::packed(loc.offset).is_none() {
                                sent.insert(loc.pool);
                            }
                            fds.push(f);
                        }
                        loc
                    }));
                }
                Body::Retrieved { items: out }
            }
            Op::Release { gens } => {
                check_batch(gens.len())?;
                store.release(session()?, &gens);
                Body::Done
            }
            Op::Accessed { gens } => {
                check_batch(gens.len())?;
                store.accessed(&c, &gens);
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
            Op::Hold { ns, keys, hold } => {
                check_batch(keys.len())?;
                Body::Batch {
                    results: batch(store.hold(session()?, &ns, &keys, hold)?),
                }
            }
            Op::Index { ns } => {
                let grant = store.index_fd(&c, &ns)?;
                fds.push(grant.table);
                let mut send = |v: Vec<(u32, std::fs::File)>| -> Vec<u32> {
                    v.into_iter()
                        .map(|(pool, dir)| {
                            fds.push(dir);
                            pool
                        })
                        .collect()
                };
                let dirs = send(grant.dirs);
                let packs = send(grant.packs);
                Body::Index {
                    slots: grant.slots,
                    dirs,
                    packs,
                }
            }
            Op::List { ns, paged, after } => {
                let (ns, children, entries, more) = match paged {
                    true => {
                        let (me, cs, es, rest) =
                            store.list(&c, &ns, after.as_deref(), PAGE_ITEMS)?;
                        let (cs, es, cut) = page(cs, es, PAGE_BYTES);
                        (me, cs, es, rest || cut)
                    }
                    false => store.list(&c, &ns, None, usize::MAX)?,
                };
                Body::Listing {
                    ns,
                    children,
                    entries,
                    more,
                }
            }
            Op::Stats => Body::Stats(store.stats()),
            Op::Lane => {
                if self.lane.is_some() {
                    return Err(Error::Protocol("this connection has a lane already".into()));
                }
                let (lane, file) = maru::lane::create()?;
                self.lane = Some(lane);
                fds.push(file);
                Body::Lane {
                    bytes: maru::lane::LANE_BYTES as u64,
                }
            }
            Op::Evict { bytes } => {
                let (entries, bytes) = store.evict(&c, bytes)?;
                Body::Evicted { entries, bytes }
            }
        })
    }
}

/// The JSON bytes a page of a paged listing may take: half a frame.
const PAGE_BYTES: usize = proto::MAX_FRAME / 2;

/// The names a page of a paged listing takes from the store at most (one pass over the
/// namespace each, and a sort of these).
const PAGE_ITEMS: usize = 16_384;

/// The first of a listing's `children` and `entries` (each sorted by name, as the store
/// lists them), in name order, as many as fit in `budget` bytes of JSON (one at least); and
/// whether names remain after them.
fn page(
    children: Vec<NsInfo>,
    entries: Vec<Located>,
    budget: usize,
) -> (Vec<NsInfo>, Vec<Located>, bool) {
    // A child's name is the last part of its path; no name is both a child and an entry.
    let name = |c: &NsInfo| c.ns.rsplit('/').next().unwrap_or_default().to_owned();
    let mut cs = children.into_iter().peekable();
    let mut es = entries.into_iter().peekable();
    let (mut pc, mut pe, mut bytes) = (Vec::new(), Vec::new(), 0);
    loop {
        let child = match (cs.peek(), es.peek()) {
            (None, None) => return (pc, pe, false),
            (Some(c), Some(e)) => name(c) < e.key,
            (c, _) => c.is_some(),
        };
        let size = match child {
            true => json_len(cs.peek().expect("peeked")),
            false => json_len(es.peek().expect("peeked")),
        };
        if bytes + size > budget && !(pc.is_empty() && pe.is_empty()) {
            return (pc, pe, true);
        }
        bytes += size;
        match child {
            true => pc.extend(cs.next()),
            false => pe.extend(es.next()),
        }
    }
}

/// The bytes of `v`'s JSON in a list (its comma included).
fn json_len<T: serde::Serialize>(v: &T) -> usize {
    serde_json::to_vec(v).map_or(0, |v| v.len()) + 1
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

#[cfg(test)]
mod tests {
    use super::*;

    fn child(ns: &str) -> NsInfo {
        NsInfo {
            ns: ns.into(),
            uid: 0,
            gid: 0,
            mode: 0o755,
            entries: 0,
            bytes: 0,
            quota: None,
        }
    }

    fn entry(key: &str) -> Located {
        Located {
            key: key.into(),
            generation: 1,
            pool: 0,
            offset: 0,
            size: 1,
            pinned: false,
            holds: 0,
            fd: false,
        }
    }

    /// Every name of a listing, page after page of `budget` bytes; and how many pages.
    fn pages(children: &[&str], entries: &[&str], budget: usize) -> (Vec<String>, usize) {
        let (mut names, mut n, mut after) = (Vec::new(), 0, None::<String>);
        loop {
            // As the store gives them: the names after the last page's.
            let later = |n: &&&str| after.as_deref().is_none_or(|a| **n > a);
            let (c, e, more) = page(
                children
                    .iter()
                    .filter(later)
                    .map(|c| child(&format!("t/{c}")))
                    .collect(),
                entries.iter().filter(later).map(|e| entry(e)).collect(),
                budget,
            );
            n += 1;
            let mut got: Vec<String> = c.iter().map(|c| c.ns[2..].to_owned()).collect();
            got.extend(e.iter().map(|e| e.key.clone()));
            got.sort();
            names.extend(got.iter().cloned());
            if !more {
                return (names, n);
            }
            after = got.last().cloned();
        }
    }

    #[test]
    fn a_listing_s_pages_give_every_name_once_in_order() {
        let children = ["b", "d2", "x"];
        let entries = ["a", "c", "d1", "e", "y", "z"];
        let mut all: Vec<String> = children
            .iter()
            .chain(&entries)
            .map(|s| s.to_string())
            .collect();
        all.sort();
        // One page when it all fits; a name a page when none fits with another.
        assert_eq!(pages(&children, &entries, 1 << 20), (all.clone(), 1));
        assert_eq!(pages(&children, &entries, 1), (all.clone(), all.len()));
        // Pages of two or three names.
        let (names, n) = pages(&children, &entries, 2 * json_len(&entry("a")) + 4);
        assert_eq!(names, all);
        assert!((3..=6).contains(&n), "{n} pages");
        // Nothing left.
        let (c, e, more) = page(vec![], vec![], 1 << 20);
        assert!(c.is_empty() && e.is_empty() && !more);
    }
}
