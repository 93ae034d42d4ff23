//! One worker's connection: its hello, its store session, its tickets and their TTLs.
//!
//! A write ticket is an allocation of the session (its id is the ticket); a read ticket is a
//! lease on an entry (a ticket of its own, naming the entry's generation). The connection's
//! thread serves requests in order and, between them (at least once a second), ends the
//! tickets whose TTL ran out. When the connection ends, its reservations are freed and its
//! leases dropped at once; quarantined pages stay allocated until their own TTL, on a thread
//! that then closes the session.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::store::SessionId;
use maru::{Error, Result};
use maru_fsd::Caller;
use maru_remote::proto::{
    self, FrameError, Listed, Listing, Op, Outcome, Page, Published, Reply, Response, Welcome,
};

use super::listing::{self, Cursor};
use super::state::{Shared, WorkerInfo};

/// How long a connection may take to say hello.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// How often an idle connection checks its tickets' TTLs.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// How long an answer may wait for the worker to read it.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

struct WriteTicket {
    size: u64,
    deadline: Instant,
    quarantined: bool,
}

struct ReadTicket {
    generation: u64,
    size: u64,
    deadline: Instant,
}

struct Conn {
    shared: Arc<Shared>,
    id: u64,
    session: SessionId,
    caller: Caller,
    writes: HashMap<u64, WriteTicket>,
    reads: HashMap<u64, ReadTicket>,
    next_read: u64,
    /// The listing this connection reads page by page (`list`), until its last page.
    listing: Option<Cursor>,
    requests: u64,
    errors: u64,
}

/// Serves one worker until its connection ends.
pub(super) fn serve(shared: Arc<Shared>, stream: TcpStream, id: u64) {
    let peer = stream
        .peer_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let _ = stream.set_nodelay(true);
    match hello(&shared, &stream, peer, id) {
        Ok(Some(mut conn)) => {
            shared.stats.connections.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = conn.run(&stream) {
                tracing::info!(worker = id, %peer, "remote worker gone: {e}");
            }
            conn.close();
        }
        Ok(None) => {
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, "remote hello failed: {e}");
        }
    }
}

/// Reads the hello, admits or refuses the worker, answers.
fn hello(
    shared: &Arc<Shared>,
    stream: &TcpStream,
    peer: SocketAddr,
    id: u64,
) -> std::result::Result<Option<Conn>, FrameError> {
    stream.set_read_timeout(Some(HELLO_WITHIN))?;
    let mut reader = BufReader::new(stream);
    let mut writer = BufWriter::new(stream);
    let mut body = Vec::new();
    match proto::read_frame(&mut reader, &mut body) {
        Ok(Some(())) => {}
        Ok(None) => return Ok(None),
        Err(e @ FrameError::TooLarge(_)) => {
            answer_err(&mut writer, shared, 0, &Error::Protocol(e.to_string()))?;
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    let req = match proto::decode_request(&body) {
        Ok(r) => r,
        Err(e) => {
            answer_err(&mut writer, shared, 0, &Error::Protocol(e.to_string()))?;
            return Ok(None);
        }
    };
    let Op::Hello {
        version,
        token,
        node,
        metadata,
    } = &req.op
    else {
        let e = Error::Protocol(format!(
            "the first request must be hello, not {}",
            req.op.name()
        ));
        answer_err(&mut writer, shared, req.id, &e)?;
        return Ok(None);
    };
    if *version != proto::VERSION {
        let e = Error::Protocol(format!(
            "protocol version {version} is not spoken here (this marud speaks {})",
            proto::VERSION
        ));
        answer_err(&mut writer, shared, req.id, &e)?;
        return Ok(None);
    }
    let Some(who) = shared.tokens.admit(token) else {
        tracing::warn!(%peer, node, "remote worker refused: bad token");
        let e = Error::PermissionDenied("the remote door refused this worker's token".into());
        answer_err(&mut writer, shared, req.id, &e)?;
        return Ok(None);
    };
    let caller = Caller::new(who.uid, who.gid, 0);
    let session = shared
        .store
        .open_session(&format!("remote:{node}"), caller.clone());
    let s = &shared.settings;
    let welcome = Welcome {
        generation: shared.generation,
        pool: shared.pool_uuid.clone(),
        page_align: maru::format::ENTRY_ALIGN,
        reserve_ttl_ms: s.reserve_ttl.as_millis() as u64,
        read_ttl_ms: s.read_ttl.as_millis() as u64,
        quarantine_ttl_ms: s.quarantine_ttl.as_millis() as u64,
        max_items: proto::MAX_ITEMS,
        uid: who.uid,
        gid: who.gid,
        registration: shared.registration.clone(),
    };
    if let Err(e) = answer(
        &mut writer,
        shared,
        req.id,
        Outcome::Ok(Reply::Hello(welcome)),
    ) {
        shared.store.close_session(session);
        return Err(e.into());
    }
    tracing::info!(
        worker = id,
        %peer,
        node,
        identity = who.name,
        metadata = metadata.0.len(),
        "remote worker connected"
    );
    shared.stats.workers.lock().push(WorkerInfo {
        id,
        node: node.clone(),
        peer,
        identity: who.name,
        uid: who.uid,
        gid: who.gid,
        reserved: 0,
        protected: 0,
        requests: 0,
        errors: 0,
    });
    Ok(Some(Conn {
        shared: shared.clone(),
        id,
        session,
        caller,
        writes: HashMap::new(),
        reads: HashMap::new(),
        next_read: 1,
        listing: None,
        requests: 0,
        errors: 0,
    }))
}

fn answer(w: &mut impl Write, shared: &Shared, id: u64, outcome: Outcome) -> std::io::Result<()> {
    let r = Response {
        id,
        generation: shared.generation,
        registration: shared.registration.version,
        outcome,
    };
    proto::write_frame(w, &r)?;
    w.flush()
}

fn answer_err(w: &mut impl Write, shared: &Shared, id: u64, e: &Error) -> std::io::Result<()> {
    answer(w, shared, id, Outcome::Err(e.to_wire()))
}

impl Conn {
    fn run(&mut self, stream: &TcpStream) -> std::result::Result<(), FrameError> {
        stream.set_read_timeout(Some(SWEEP_EVERY))?;
        // A worker that stops reading its answers (paused, frozen) does not keep this thread
        // from its sweeps for ever: the connection ends, its tickets with it.
        stream.set_write_timeout(Some(ANSWER_WITHIN))?;
        let mut reader = BufReader::new(stream);
        let mut writer = BufWriter::new(stream);
        let mut body = Vec::new();
        loop {
            match proto::read_frame(&mut reader, &mut body) {
                Ok(Some(())) => {}
                Ok(None) => return Ok(()),
                Err(FrameError::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    // Idle (a timeout between frames leaves the reader where it was).
                    self.sweep();
                    continue;
                }
                Err(e) => {
                    // Oversized or cut: say why, then end the connection.
                    let _ = answer_err(
                        &mut writer,
                        &self.shared,
                        0,
                        &Error::Protocol(e.to_string()),
                    );
                    return Err(e);
                }
            }
            self.sweep();
            let req = match proto::decode_request(&body) {
                Ok(r) => r,
                Err(e) => {
                    self.count_error();
                    let _ = answer_err(
                        &mut writer,
                        &self.shared,
                        0,
                        &Error::Protocol(e.to_string()),
                    );
                    return Err(e);
                }
            };
            self.requests += 1;
            self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
            let outcome = if req.generation != self.shared.generation {
                Err(Error::Protocol(format!(
                    "generation {:016x} is over: this marud runs {:016x}; reconnect",
                    req.generation, self.shared.generation
                )))
                .map_err(|e| {
                    let mut w = e.to_wire();
                    w.kind = proto::STALE_GENERATION.into();
                    w
                })
            } else {
                crate::store::take_sync_failure();
                let r = self.handle(req.op);
                // A record of the verb's that could not be synced: not a success.
                match crate::store::take_sync_failure() {
                    Some(e) if r.is_ok() => Err(e.to_wire()),
                    _ => r.map_err(|e| e.to_wire()),
                }
            };
            let outcome = match outcome {
                Ok(reply) => Outcome::Ok(reply),
                Err(w) => {
                    self.count_error();
                    Outcome::Err(w)
                }
            };
            answer(&mut writer, &self.shared, req.id, outcome)?;
            self.publish_info();
        }
    }

    fn count_error(&mut self) {
        self.errors += 1;
        self.shared.stats.errors.fetch_add(1, Ordering::Relaxed);
    }

    fn handle(&mut self, op: Op) -> Result<Reply> {
        let store = self.shared.store.clone();
        match op {
            Op::Hello { .. } => Err(Error::Protocol("hello was said already".into())),
            Op::Metadata => Ok(Reply::Metadata(self.shared.registration.clone())),
            Op::Mkdir { ns, mode } => {
                // Each missing level, as the worker (the policy decides, as for a local mkdir).
                let mut path = String::new();
                for part in ns.split('/') {
                    if !path.is_empty() {
                        path.push('/');
                    }
                    path.push_str(part);
                    match store.mkdir(&self.caller, &path, mode & 0o7777) {
                        Ok(_) | Err(Error::Exists(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(Reply::Done)
            }
            Op::Ping => Ok(Reply::Pong),
            Op::Reserve { ns, sizes } => self.reserve(&ns, &sizes).map(Reply::Reserved),
            Op::Publish { ns, items } => {
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    out.push(self.publish(&ns, it.ticket, &it.key, it.len));
                }
                Ok(Reply::Published(out))
            }
            Op::Abandon { tickets } => {
                let mine: Vec<u64> = tickets
                    .into_iter()
                    .filter(|t| self.writes.remove(t).is_some())
                    .collect();
                store.free(self.session, &mine)?;
                Ok(Reply::Done)
            }
            Op::Quarantine { tickets } => {
                let until = Instant::now() + self.shared.settings.quarantine_ttl;
                for t in tickets {
                    if let Some(w) = self.writes.get_mut(&t) {
                        w.quarantined = true;
                        w.deadline = until;
                        self.shared
                            .stats
                            .quarantined
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(Reply::Done)
            }
            Op::Exists { ns, keys } => store.exists(&self.caller, &ns, &keys).map(Reply::Exists),
            Op::Lookup { ns, keys } => self.lookup(&ns, &keys).map(Reply::Found),
            Op::Release { tickets } => {
                let gens: Vec<u64> = tickets
                    .iter()
                    .filter_map(|t| self.reads.remove(t))
                    .map(|r| r.generation)
                    .collect();
                store.release(self.session, &gens);
                Ok(Reply::Done)
            }
            Op::Delete { ns, keys } => store
                .delete(&self.caller, &ns, &keys)
                .map(|r| Reply::Each(each(r))),
            Op::Pin { ns, keys, pinned } => store
                .pin(&self.caller, &ns, &keys, pinned)
                .map(|r| Reply::Each(each(r))),
            Op::List { ns, after } => self.list(ns, after).map(Reply::Listing),
        }
    }

    /// A page of namespace `ns`'s listing: the next of the listing this connection reads, or
    /// the first of a new one (a `list` of the store, under its policy) when `after` is not
    /// where that one stopped.
    fn list(&mut self, ns: String, after: Option<String>) -> Result<Listing> {
        let mut cursor = match self.listing.take() {
            Some(c) if c.continues(&ns, after.as_deref()) => c,
            _ => {
                let (_, children, entries, _) =
                    self.shared
                        .store
                        .list(&self.caller, &ns, None, usize::MAX)?;
                let children = children
                    .into_iter()
                    .map(|c| match c.ns.rsplit_once('/') {
                        Some((_, name)) => name.to_owned(),
                        None => c.ns,
                    })
                    .collect();
                let entries = entries
                    .into_iter()
                    .map(|e| Listed {
                        key: e.key,
                        size: e.size,
                    })
                    .collect();
                Cursor::new(ns, children, entries, after.as_deref())
            }
        };
        let page = cursor.next_page(listing::PAGE_BYTES);
        if page.more {
            self.listing = Some(cursor);
        }
        Ok(page)
    }

    /// All the pages or none.
    fn reserve(&mut self, ns: &str, sizes: &[u64]) -> Result<Vec<Page>> {
        let sh = self.shared.clone();
        if let Some(&s) = sizes.iter().find(|&&s| s == 0 || s > sh.len) {
            return Err(Error::InvalidArgument(format!(
                "a page of {s} bytes: pages are 1 byte to the pool's {} bytes",
                sh.len
            )));
        }
        let mut pages = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let granted = sh
                .store
                .alloc(self.session, size, 1, Some(&sh.pool_name), Some(ns));
            match granted {
                Ok(g) if !g.is_empty() => {
                    let g = &g[0].0;
                    pages.push(Page {
                        ticket: g.alloc,
                        addr: sh.base + g.offset,
                        len: size,
                    });
                }
                other => {
                    let ids: Vec<u64> = pages.iter().map(|p| p.ticket).collect();
                    let _ = sh.store.free(self.session, &ids);
                    return Err(match other {
                        Err(Error::NoSpace(m)) => Error::NoSpace(format!("pool full: {m}")),
                        Err(e) => e,
                        Ok(_) => Error::NoSpace("pool full".into()),
                    });
                }
            }
        }
        let deadline = Instant::now() + sh.settings.reserve_ttl;
        for p in &pages {
            self.writes.insert(
                p.ticket,
                WriteTicket {
                    size: p.len,
                    deadline,
                    quarantined: false,
                },
            );
        }
        sh.stats
            .pages_reserved
            .fetch_add(pages.len() as u64, Ordering::Relaxed);
        sh.stats
            .bytes_reserved
            .fetch_add(sizes.iter().sum::<u64>(), Ordering::Relaxed);
        Ok(pages)
    }

    fn publish(&mut self, ns: &str, ticket: u64, key: &str, len: u64) -> Published {
        match self.writes.get(&ticket) {
            None => {
                return Published::Rejected(
                    Error::InvalidArgument(format!(
                        "ticket {ticket} is not a reservation of yours"
                    ))
                    .to_wire(),
                );
            }
            Some(w) if w.quarantined => {
                return Published::Rejected(
                    Error::Busy(format!("ticket {ticket} is quarantined")).to_wire(),
                );
            }
            Some(_) => {}
        }
        self.writes.remove(&ticket);
        match self
            .shared
            .store
            .publish(self.session, ticket, ns, key, Some(len))
        {
            Ok(_) => {
                self.shared.stats.published.fetch_add(1, Ordering::Relaxed);
                Published::Created
            }
            Err(Error::Exists(_)) => Published::AlreadyPresent,
            Err(e) => Published::Rejected(e.to_wire()),
        }
    }

    /// Finds entries of the remote pool and protects each for the read that follows.
    fn lookup(&mut self, ns: &str, keys: &[String]) -> Result<Vec<Option<Page>>> {
        let sh = self.shared.clone();
        sh.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let found = sh.store.retrieve(self.session, ns, keys, |_| true)?;
        let deadline = Instant::now() + sh.settings.read_ttl;
        let mut out = Vec::with_capacity(found.len());
        let mut elsewhere = Vec::new();
        for item in found {
            let Some((loc, _)) = item else {
                out.push(None);
                continue;
            };
            if loc.pool != sh.pool {
                // In a pool the door does not serve (a memfs pool): not reachable remotely.
                out.push(None);
                elsewhere.push(loc.generation);
                continue;
            }
            let ticket = self.next_read;
            self.next_read += 1;
            self.reads.insert(
                ticket,
                ReadTicket {
                    generation: loc.generation,
                    size: loc.size,
                    deadline,
                },
            );
            sh.stats
                .bytes_protected
                .fetch_add(loc.size, Ordering::Relaxed);
            out.push(Some(Page {
                ticket,
                addr: sh.base + loc.offset,
                len: loc.size,
            }));
        }
        if !elsewhere.is_empty() {
            sh.store.release(self.session, &elsewhere);
        }
        Ok(out)
    }

    /// Ends the tickets whose TTL ran out. A reservation neither published nor given back
    /// is quarantined first (a WRITE into it may still be landing: the NIC's path is not
    /// this connection), and freed when its quarantine ends.
    fn sweep(&mut self) {
        let now = Instant::now();
        let quarantine = now + self.shared.settings.quarantine_ttl;
        let mut quarantined = 0;
        for w in self.writes.values_mut() {
            if w.deadline <= now && !w.quarantined {
                w.quarantined = true;
                w.deadline = quarantine;
                quarantined += 1;
            }
        }
        if quarantined > 0 {
            self.shared
                .stats
                .quarantined
                .fetch_add(quarantined, Ordering::Relaxed);
        }
        let expired: Vec<u64> = self
            .writes
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(t, _)| *t)
            .collect();
        if !expired.is_empty() {
            for t in &expired {
                self.writes.remove(t);
            }
            let _ = self.shared.store.free(self.session, &expired);
        }
        let stale: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(t, _)| *t)
            .collect();
        let gens: Vec<u64> = stale
            .iter()
            .filter_map(|t| self.reads.remove(t))
            .map(|r| r.generation)
            .collect();
        if !gens.is_empty() {
            self.shared.store.release(self.session, &gens);
        }
        let n = (expired.len() + gens.len()) as u64;
        if n > 0 {
            self.shared.stats.expired.fetch_add(n, Ordering::Relaxed);
            tracing::info!(worker = self.id, expired = n, "remote tickets expired");
            self.publish_info();
        }
    }

    /// Refreshes this worker's line in the door's list.
    fn publish_info(&self) {
        let mut workers = self.shared.stats.workers.lock();
        if let Some(w) = workers.iter_mut().find(|w| w.id == self.id) {
            w.reserved = self.writes.values().map(|t| t.size).sum();
            w.protected = self.reads.values().map(|r| r.size).sum();
            w.requests = self.requests;
            w.errors = self.errors;
        }
    }

    /// The connection ended: leases dropped, the session closed, except that reservations
    /// neither published nor given back stay allocated until a quarantine's end (a WRITE into
    /// them may still be landing: the NIC's path outlives this connection), then the session
    /// closes and frees them.
    fn close(mut self) {
        self.shared.stats.workers.lock().retain(|w| w.id != self.id);
        let store = self.shared.store.clone();
        let gens: Vec<u64> = self.reads.drain().map(|(_, r)| r.generation).collect();
        store.release(self.session, &gens);
        let quarantine = Instant::now() + self.shared.settings.quarantine_ttl;
        let until = self
            .writes
            .drain()
            .map(|(_, w)| {
                if w.quarantined {
                    w.deadline
                } else {
                    quarantine
                }
            })
            .max();
        let Some(until) = until else {
            store.close_session(self.session);
            return;
        };
        let session = self.session;
        let keeper = store.clone();
        let spawned = std::thread::Builder::new()
            .name("remote-quarantine".into())
            .spawn(move || {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                keeper.close_session(session);
            });
        if let Err(e) = spawned {
            tracing::warn!("quarantined pages: no thread to keep them ({e}); freed now");
            store.close_session(session);
        }
    }
}

/// One optional error per key.
fn each(r: Vec<Result<()>>) -> Vec<Option<maru::error::WireError>> {
    r.into_iter()
        .map(|x| x.err().map(|e| e.to_wire()))
        .collect()
}
