//! A connection's shared-memory lane: one request and one reply at a time in a memory file
//! that the client and marud both map, so a call the client waits for costs no `sendmsg` or
//! `recvmsg` (on virtual machines those four system calls take more of a small store's time
//! than marud's work). The socket stays the connection: descriptors, pipelined requests,
//! replies too large for the lane, and the nudges that wake a side that went to sleep.
//!
//! marud creates the file when a client asks (`Op::Lane`), seals its size and sends it. Every
//! word is accessed as an `AtomicU64` (each side writes memory the other reads at any time).
//! Layout (little-endian `u64` words; see `doc/PROTOCOL.md`):
//!
//! ```text
//! word 0   request id (the client writes it last: a request is there when it changes)
//! word 1   request length in bytes
//! word 8   marud is asleep (1) on the socket, not polling the lane
//! word 16  id of the reply in the lane (marud writes it last)
//! word 17  reply length in bytes; all ones: the reply is on the socket
//! word 24  the client is asleep (1) on the socket
//! byte 4096             request bytes (LANE_CAP)
//! byte 4096 + LANE_CAP  reply bytes (LANE_CAP)
//! ```
//!
//! A reply with descriptors, or larger than the lane, goes on the socket; marud then says so
//! in the lane (after sending it), so a client waiting for a lane reply polls only the lane.
//!
//! A side that finds the other asleep after writing sends it a nudge on the socket: an empty
//! frame, which every frame reader skips ([`crate::proto::FrameReader::next_frame`]). A side
//! announces sleep before its last look at the lane, and the writer looks for the
//! announcement after writing (both sequentially consistent), so one of the two always sees
//! the other.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// Most bytes of one request or one reply in the lane; larger ones go on the socket.
pub const LANE_CAP: usize = 64 << 10;
const HEADER: usize = 4096;
/// Bytes of a lane file.
pub const LANE_BYTES: usize = HEADER + 2 * LANE_CAP;

const REQ_ID: usize = 0;
const REQ_LEN: usize = 1;
const SERVER_ASLEEP: usize = 8;
const REPLY_ID: usize = 16;
const REPLY_LEN: usize = 17;
const CLIENT_ASLEEP: usize = 24;
const REQ_AT: usize = HEADER / 8;
const REPLY_AT: usize = (HEADER + LANE_CAP) / 8;

/// The reply length that says the reply is on the socket.
const ON_SOCKET: u64 = u64::MAX;

/// The frame a sleeping side is woken with: an empty body.
pub const NUDGE: [u8; 4] = [0; 4];

/// What the lane holds for a request the client waits for.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The reply's bytes.
    Here(Vec<u8>),
    /// marud answered on the socket (descriptors, or too large for the lane).
    OnSocket,
}

/// A mapped lane (either side).
pub struct Lane {
    map: memmap2::MmapRaw,
    /// marud's side: the id of the last request taken.
    taken: u64,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("taken", &self.taken).finish()
    }
}

impl Lane {
    /// Maps a lane file, checking its size.
    pub fn map(file: &File) -> Result<Lane> {
        let len = file.metadata()?.len();
        if len != LANE_BYTES as u64 {
            return Err(Error::Protocol(format!(
                "a lane of {len} bytes (expected {LANE_BYTES})"
            )));
        }
        let map = memmap2::MmapOptions::new().len(LANE_BYTES).map_raw(file)?;
        Ok(Lane { map, taken: 0 })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page aligned, LANE_BYTES long and lives as long as self;
        // every access to it, here and in the other process, is through atomics.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), LANE_BYTES / 8) }
    }

    fn put(&self, at: usize, bytes: &[u8]) {
        let w = &self.words()[at..];
        for (i, c) in bytes.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            w[i].store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
    }

    fn get(&self, at: usize, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len.next_multiple_of(8));
        for w in &self.words()[at..at + len.div_ceil(8)] {
            out.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// Writes `body` at word `at`, its length at word `len`, then `id` at word `id_at`; true
    /// when the reader's word `asleep` says it sleeps on the socket.
    fn post(&self, [at, len, id_at, asleep]: [usize; 4], id: u64, body: &[u8]) -> bool {
        assert!(
            body.len() <= LANE_CAP,
            "a message in the lane fits the lane"
        );
        let w = self.words();
        self.put(at, body);
        w[len].store(body.len() as u64, Ordering::Relaxed);
        w[id_at].store(id, Ordering::SeqCst);
        w[asleep].load(Ordering::SeqCst) != 0
    }

    /// Client: posts request `id` (at most [`LANE_CAP`] bytes). True when marud is asleep and
    /// must be nudged.
    pub fn post_request(&self, id: u64, body: &[u8]) -> bool {
        self.post([REQ_AT, REQ_LEN, REQ_ID, SERVER_ASLEEP], id, body)
    }

    /// Client: true when the reply to request `id` is in the lane (one load: what a client
    /// polls).
    pub fn has_reply(&self, id: u64) -> bool {
        self.words()[REPLY_ID].load(Ordering::Acquire) == id
    }

    /// Client: the reply to request `id`, if marud gave it: its bytes, or word that it is
    /// on the socket.
    pub fn reply(&self, id: u64) -> Option<Reply> {
        if !self.has_reply(id) {
            return None;
        }
        let w = self.words();
        let len = w[REPLY_LEN].load(Ordering::Relaxed);
        if len == ON_SOCKET {
            return Some(Reply::OnSocket);
        }
        Some(Reply::Here(
            self.get(REPLY_AT, (len as usize).min(LANE_CAP)),
        ))
    }

    /// Client: says it sleeps on the socket (`true`) or is awake. True when the reply to
    /// request `id` arrived meanwhile.
    pub fn client_asleep(&self, asleep: bool, id: u64) -> bool {
        let w = self.words();
        w[CLIENT_ASLEEP].store(u64::from(asleep), Ordering::SeqCst);
        w[REPLY_ID].load(Ordering::SeqCst) == id
    }

    /// marud: true when a request not taken yet is in the lane.
    pub fn has_request(&self) -> bool {
        self.words()[REQ_ID].load(Ordering::Acquire) != self.taken
    }

    /// marud: takes the request in the lane, if a new one is there: its id and a copy of its
    /// bytes (the client can write the lane at any time). A length over [`LANE_CAP`] is an
    /// error.
    pub fn take_request(&mut self) -> Option<Result<(u64, Vec<u8>)>> {
        let id = self.words()[REQ_ID].load(Ordering::Acquire);
        if id == self.taken {
            return None;
        }
        self.taken = id;
        let len = self.words()[REQ_LEN].load(Ordering::Relaxed) as usize;
        if len > LANE_CAP {
            return Some(Err(Error::Protocol(format!(
                "a lane request of {len} bytes exceeds the lane's {LANE_CAP}"
            ))));
        }
        Some(Ok((id, self.get(REQ_AT, len))))
    }

    /// marud: says it sleeps on the socket (`true`) or polls. True when a request arrived
    /// meanwhile.
    pub fn server_asleep(&self, asleep: bool) -> bool {
        let w = self.words();
        w[SERVER_ASLEEP].store(u64::from(asleep), Ordering::SeqCst);
        w[REQ_ID].load(Ordering::SeqCst) != self.taken
    }

    /// marud: posts the reply to request `id` (at most [`LANE_CAP`] bytes). True when the
    /// client is asleep and must be nudged.
    pub fn post_reply(&self, id: u64, body: &[u8]) -> bool {
        self.post([REPLY_AT, REPLY_LEN, REPLY_ID, CLIENT_ASLEEP], id, body)
    }

    /// marud: says that the reply to request `id` was sent on the socket (after sending it:
    /// a client asleep there is woken by the reply itself).
    pub fn replied_on_socket(&self, id: u64) {
        let w = self.words();
        w[REPLY_LEN].store(ON_SOCKET, Ordering::Relaxed);
        w[REPLY_ID].store(id, Ordering::SeqCst);
    }
}

/// marud: a new lane file (a sealed memfd of [`LANE_BYTES`]: the client can write it but
/// not resize it) and its mapping.
pub fn create() -> Result<(Lane, File)> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(
        c"maru-lane",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(std::io::Error::from)?;
    let file = File::from(fd);
    file.set_len(LANE_BYTES as u64)?;
    fcntl(
        &file,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(std::io::Error::from)?;
    let lane = Lane::map(&file)?;
    Ok((lane, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_and_its_reply_cross_the_lane() {
        let (mut server, file) = create().unwrap();
        let client = Lane::map(&file).unwrap();
        assert!(server.take_request().is_none());
        assert!(!client.post_request(7, b"odd length body"));
        assert!(server.has_request());
        let (id, body) = server.take_request().unwrap().unwrap();
        assert_eq!((id, &body[..]), (7, &b"odd length body"[..]));
        assert!(server.take_request().is_none(), "taken once");
        assert!(client.reply(7).is_none() && !client.has_reply(7));
        assert!(!server.post_reply(7, b"{}"));
        assert!(client.has_reply(7) && !client.has_reply(8));
        assert_eq!(client.reply(7), Some(Reply::Here(b"{}".to_vec())));
        server.replied_on_socket(9);
        assert_eq!(client.reply(9), Some(Reply::OnSocket));
        // Sleep announcements are seen by the writer.
        assert!(!server.server_asleep(true));
        assert!(client.post_request(8, &[1; LANE_CAP]));
        assert!(
            server.server_asleep(false),
            "the request is seen after the announcement"
        );
        assert_eq!(server.take_request().unwrap().unwrap().1, vec![1; LANE_CAP]);
        assert!(!client.client_asleep(true, 8));
        assert!(server.post_reply(8, b"x"));
        assert!(client.client_asleep(false, 8));
    }

    #[test]
    fn a_lane_cannot_be_resized_and_a_bad_length_is_refused() {
        let (mut server, file) = create().unwrap();
        assert!(file.set_len(1).is_err(), "shrinking is sealed");
        assert!(
            file.set_len(LANE_BYTES as u64 * 2).is_err(),
            "growing is sealed"
        );
        let client = Lane::map(&file).unwrap();
        client.post_request(1, b"x");
        client.words()[REQ_LEN].store(u64::MAX, Ordering::SeqCst);
        assert!(matches!(
            server.take_request(),
            Some(Err(Error::Protocol(_)))
        ));
    }
}
