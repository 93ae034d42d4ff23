//! maru's etcd v3 client: the few RPCs the cluster metadata calls, over tonic.
//!
//! The messages and gRPC stubs in `pb/` are generated from `cluster/proto/*.proto` (a subset
//! of etcd's API with etcd's own field numbers) by `cluster/proto/regen.sh`, and committed: a
//! build of maru runs no protobuf compiler, so it needs nothing but Rust and a C compiler.
//! CI checks that the committed code matches the `.proto` files.
//!
//! What is here: one channel balanced over the endpoints (each request bounded by the
//! patience given at connect), the `hasleader` requirement etcd honours so that a member cut
//! off from its quorum refuses rather than serves stale reads, range/put/delete/transaction,
//! compaction, watches, leases and the maintenance status.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// etcd's messages and gRPC clients, generated (see the module's documentation).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pb {
    /// Keys, values and watch events.
    pub mod mvccpb {
        include!("pb/mvccpb.rs");
    }
    /// The KV, Watch, Lease and Maintenance services.
    pub mod etcdserverpb {
        include!("pb/etcdserverpb.rs");
    }
}

use pb::etcdserverpb as rpc;
pub use pb::mvccpb::{Event, KeyValue, event::EventType};
use rpc::kv_client::KvClient;
use rpc::lease_client::LeaseClient;
use rpc::maintenance_client::MaintenanceClient;
use rpc::watch_client::WatchClient;
pub use rpc::{RangeResponse, StatusResponse, WatchResponse};

/// What can go wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An endpoint that is not a URL.
    #[error("endpoint {0:?}: {1}")]
    Endpoint(String, String),
    /// No endpoint was given.
    #[error("no etcd endpoint given")]
    NoEndpoint,
    /// The request failed: unreachable, timed out, or refused by etcd.
    #[error("{}", describe(.0))]
    Status(#[from] tonic::Status),
    /// A watch or keep-alive stream could not take another request (the call ended).
    #[error("the stream to etcd ended")]
    StreamEnded,
}

impl Error {
    /// Whether the request never reached etcd: its connection was refused, or its host or
    /// network unreachable, so its outcome is known (nothing happened).
    pub fn never_sent(&self) -> bool {
        let Error::Status(s) = self else {
            return matches!(self, Error::Endpoint(..) | Error::NoEndpoint);
        };
        not_sent(s)
    }
}

/// Whether a request that failed with `s` never reached etcd: the connection to its member
/// was refused, or the member's host or network unreachable.
fn not_sent(s: &tonic::Status) -> bool {
    use std::error::Error as _;
    let mut cause = s.source();
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            )
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A status as one line: etcd's message, or what the transport says went wrong.
fn describe(s: &tonic::Status) -> String {
    use std::error::Error as _;
    let mut text = format!("{:?}: {}", s.code(), s.message());
    let mut cause = s.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

pub type Result<T> = std::result::Result<T, Error>;

/// Adds etcd's `hasleader` header: a member without a leader refuses the request.
#[derive(Clone)]
pub struct RequireLeader(bool);

impl tonic::service::Interceptor for RequireLeader {
    fn call(
        &mut self,
        mut r: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if self.0 {
            r.metadata_mut()
                .insert("hasleader", AsciiMetadataValue::from_static("true"));
        }
        Ok(r)
    }
}

type Service = InterceptedService<Channel, RequireLeader>;

/// [`Client::again`] with request `$req` to service `$svc`'s `$rpc`, a fresh clone of both
/// for each try.
macro_rules! again {
    ($self:ident, $svc:ident . $rpc:ident ($req:expr)) => {
        $self.again(|| {
            let (mut svc, req) = ($self.$svc.clone(), $req.clone());
            async move { svc.$rpc(req).await }
        })
    };
}

/// The largest reply taken from etcd (gRPC's own limit on a message).
const MAX_REPLY: usize = i32::MAX as usize;

/// A connection to an etcd cluster. Cheap to clone: clones share the channel.
#[derive(Clone)]
pub struct Client {
    kv: KvClient<Service>,
    watch: WatchClient<Service>,
    lease: LeaseClient<Service>,
    maintenance: MaintenanceClient<Service>,
    /// How long a request may take, refusals for want of a leader retried included.
    patience: Duration,
    /// It balances requests over more than one member: one that cannot reach its member is
    /// sent again (to another, maybe).
    several: bool,
}

/// How a [`Client`] connects.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Bounds each request, the connection's establishment, and HTTP/2 keep-alive's wait for
    /// a dead peer.
    pub patience: Duration,
    /// Refuse requests a member without a leader would answer (etcd's `hasleader`).
    pub require_leader: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            patience: Duration::from_secs(5),
            require_leader: false,
        }
    }
}

impl Client {
    /// A client of the etcd members at `endpoints` (`http://HOST:PORT`, or `HOST:PORT`).
    /// Connections are made on first use, so this fails only on malformed endpoints.
    pub fn connect<S: AsRef<str>>(endpoints: &[S], options: Options) -> Result<Self> {
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let e = e.as_ref().trim();
            let url = if e.contains("://") {
                e.to_owned()
            } else {
                format!("http://{e}")
            };
            let p = options.patience;
            let endpoint = Endpoint::from_shared(url)
                .map_err(|why| Error::Endpoint(e.to_owned(), why.to_string()))?
                .timeout(p)
                .connect_timeout(p)
                .http2_keep_alive_interval(p)
                .keep_alive_timeout(p)
                .keep_alive_while_idle(true)
                .tcp_nodelay(true);
            list.push(endpoint);
        }
        if list.is_empty() {
            return Err(Error::NoEndpoint);
        }
        let several = list.len() > 1;
        let channel = Channel::balance_list(list.into_iter());
        let service = InterceptedService::new(channel, RequireLeader(options.require_leader));
        Ok(Client {
            // A read of every entry of a busy pool is one reply of many MiB (20,000 entries
            // with long names: 5.6 MiB), past tonic's default limit of 4 MiB; etcd sends
            // replies of up to 2 GiB, its size limit being its keyspace's.
            kv: KvClient::new(service.clone()).max_decoding_message_size(MAX_REPLY),
            watch: WatchClient::new(service.clone()).max_decoding_message_size(MAX_REPLY),
            lease: LeaseClient::new(service.clone()),
            maintenance: MaintenanceClient::new(service),
            patience: options.patience,
            several,
        })
    }

    /// One client per endpoint of `endpoints`, each speaking to that member alone (where
    /// the caller must choose the member, not the balancer: a lease's renewals go to the
    /// next member when one fails).
    pub fn each<S: AsRef<str>>(endpoints: &[S], options: Options) -> Result<Vec<Self>> {
        endpoints
            .iter()
            .map(|e| Client::connect(std::slice::from_ref(e), options))
            .collect()
    }

    /// Sends a unary request (made afresh by `call`) again while the member that answers
    /// refuses it for want of a leader (etcd's `hasleader`: a member cut off from its quorum;
    /// every member during an election), or, for a client of several members, while the
    /// member the balancer chose cannot be reached at all (its connection refused: a member
    /// killed; the balancer goes on choosing it among the others). etcd refuses the first
    /// before doing anything with it, and never saw the second, so sending it again, which
    /// the balancer may send to another member, cannot apply it twice. A client of one
    /// member fails at once when it cannot reach it (a lease's renewals then go on through
    /// the next member's client). Gives up with the refusal once the client's patience is
    /// spent. (Seed 2484: a mount writer's publication at its release went to a killed
    /// member and failed, and the entry its close had promised was dropped, while two
    /// members could take it.)
    async fn again<T, F, Fut>(&self, mut call: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.patience;
        let mut pause = Duration::from_millis(5);
        loop {
            match call().await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s)
                    if (no_leader(&s) || (self.several && not_sent(&s)))
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(s) => return Err(s.into()),
            }
        }
    }

    /// Reads `key`, or every key `range` selects.
    pub async fn get(&self, key: impl Into<Vec<u8>>, range: Range) -> Result<RangeResponse> {
        let req = range.request(key.into());
        again!(self, kv.range(req)).await
    }

    /// Writes `key` (attached to `lease` unless 0); returns the revision of the write.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<i64> {
        let req = put_request(key, value, lease);
        let r = again!(self, kv.put(req)).await?;
        Ok(revision(r.header))
    }

    /// Deletes `key`; returns how many keys were deleted (0 or 1).
    pub async fn delete(&self, key: impl Into<Vec<u8>>) -> Result<i64> {
        let req = delete_request(key);
        let r = again!(self, kv.delete_range(req)).await?;
        Ok(r.deleted)
    }

    /// Runs a transaction.
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        let r = again!(self, kv.txn(txn.0)).await?;
        Ok(TxnResponse(r))
    }

    /// Compacts the history up to `revision` (watches that start earlier are cancelled).
    pub async fn compact(&self, revision: i64, physical: bool) -> Result<()> {
        let req = rpc::CompactionRequest { revision, physical };
        again!(self, kv.compact(req)).await?;
        Ok(())
    }

    /// Watches `key`, or every key `range` selects, from `start_revision` on (inclusive; 0:
    /// from now). `prev_kv`: deletions carry the key as it was.
    pub async fn watch(
        &self,
        key: impl Into<Vec<u8>>,
        range: Range,
        start_revision: i64,
        prev_kv: bool,
    ) -> Result<WatchStream> {
        let key = key.into();
        let create = rpc::WatchCreateRequest {
            range_end: range.end(&key),
            key,
            start_revision,
            prev_kv,
            progress_notify: false,
        };
        let (tx, rx) = mpsc::channel(4);
        tx.send(rpc::WatchRequest {
            request_union: Some(rpc::watch_request::RequestUnion::CreateRequest(create)),
        })
        .await
        .map_err(|_| Error::StreamEnded)?;
        let responses = self
            .watch
            .clone()
            .watch(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(WatchStream {
            _requests: tx,
            responses,
        })
    }

    /// Grants a lease of `ttl` seconds; returns its id.
    pub async fn lease_grant(&self, ttl: i64) -> Result<i64> {
        let req = rpc::LeaseGrantRequest { ttl, id: 0 };
        let r = again!(self, lease.lease_grant(req)).await?;
        if !r.error.is_empty() {
            return Err(Error::Status(tonic::Status::unavailable(r.error)));
        }
        Ok(r.id)
    }

    /// Revokes a lease: every key attached to it is deleted.
    pub async fn lease_revoke(&self, id: i64) -> Result<()> {
        let req = rpc::LeaseRevokeRequest { id };
        again!(self, lease.lease_revoke(req)).await?;
        Ok(())
    }

    /// Opens a keep-alive stream for lease `id`; its first renewal is on its way.
    pub async fn lease_keep_alive(&self, id: i64) -> Result<LeaseKeeper> {
        let (tx, rx) = mpsc::channel(4);
        // etcd answers the call (its headers) with its first renewal: ask for one first.
        tx.send(rpc::LeaseKeepAliveRequest { id })
            .await
            .map_err(|_| Error::StreamEnded)?;
        let responses = self
            .lease
            .clone()
            .lease_keep_alive(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(LeaseKeeper {
            id,
            requests: tx,
            responses,
            asked: true,
        })
    }

    /// The status of the member that answers (its version, the leader it knows).
    pub async fn status(&self) -> Result<StatusResponse> {
        again!(self, maintenance.status(rpc::StatusRequest {})).await
    }
}

/// Whether etcd refused a request because the member has no leader (`hasleader`): refused
/// before it was looked at.
fn no_leader(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unavailable && s.message() == "etcdserver: no leader"
}

/// The revision a response header carries (0 without one).
fn revision(header: Option<rpc::ResponseHeader>) -> i64 {
    header.map_or(0, |h| h.revision)
}

/// Which keys a read, a watch or a deletion covers beside its key, and what a read returns.
#[derive(Debug, Default, Clone, Copy)]
pub struct Range {
    /// Every key that starts with the key given.
    pub prefix: bool,
    /// Keys without their values.
    pub keys_only: bool,
    /// Only the count of keys.
    pub count_only: bool,
}

impl Range {
    /// The key alone.
    pub const KEY: Range = Range {
        prefix: false,
        keys_only: false,
        count_only: false,
    };
    /// Every key under a prefix, with values.
    pub const PREFIX: Range = Range {
        prefix: true,
        keys_only: false,
        count_only: false,
    };
    /// Every key under a prefix, without values.
    pub const KEYS_UNDER: Range = Range {
        prefix: true,
        keys_only: true,
        count_only: false,
    };
    /// How many keys are under a prefix.
    pub const COUNT_UNDER: Range = Range {
        prefix: true,
        keys_only: false,
        count_only: true,
    };

    fn end(&self, key: &[u8]) -> Vec<u8> {
        if self.prefix {
            prefix_end(key)
        } else {
            Vec::new()
        }
    }

    fn request(&self, key: Vec<u8>) -> rpc::RangeRequest {
        rpc::RangeRequest {
            range_end: self.end(&key),
            key,
            keys_only: self.keys_only,
            count_only: self.count_only,
            ..Default::default()
        }
    }
}

/// The end of the range of keys that start with `prefix`: the prefix with its last byte that
/// is not 0xff incremented (etcd's convention; `\0` for "every key" when there is none).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn put_request(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> rpc::PutRequest {
    rpc::PutRequest {
        key: key.into(),
        value: value.into(),
        lease,
        prev_kv: false,
    }
}

fn delete_request(key: impl Into<Vec<u8>>) -> rpc::DeleteRangeRequest {
    rpc::DeleteRangeRequest {
        key: key.into(),
        ..Default::default()
    }
}

/// A condition of a transaction on one key.
#[derive(Debug, Clone)]
pub struct Compare(rpc::Compare);

impl Compare {
    fn new(
        key: impl Into<Vec<u8>>,
        result: rpc::compare::CompareResult,
        target: rpc::compare::CompareTarget,
        value: rpc::compare::TargetUnion,
    ) -> Self {
        Compare(rpc::Compare {
            result: result as i32,
            target: target as i32,
            key: key.into(),
            target_union: Some(value),
            range_end: Vec::new(),
        })
    }

    /// No key in `[from, to)` exists (etcd compares a range's absent keys as created at 0).
    pub fn none_in(from: impl Into<Vec<u8>>, to: impl Into<Vec<u8>>) -> Self {
        let mut c = Self::absent(from);
        c.0.range_end = to.into();
        c
    }

    /// `key` does not exist.
    pub fn absent(key: impl Into<Vec<u8>>) -> Self {
        Self::created_at(key, rpc::compare::CompareResult::Equal)
    }

    /// `key` exists.
    pub fn present(key: impl Into<Vec<u8>>) -> Self {
        Self::created_at(key, rpc::compare::CompareResult::NotEqual)
    }

    fn created_at(key: impl Into<Vec<u8>>, result: rpc::compare::CompareResult) -> Self {
        Self::new(
            key,
            result,
            rpc::compare::CompareTarget::Create,
            rpc::compare::TargetUnion::CreateRevision(0),
        )
    }

    /// `key` was created at `revision` (and not deleted since).
    pub fn created(key: impl Into<Vec<u8>>, revision: i64) -> Self {
        Self::new(
            key,
            rpc::compare::CompareResult::Equal,
            rpc::compare::CompareTarget::Create,
            rpc::compare::TargetUnion::CreateRevision(revision),
        )
    }

    /// `key` was last written at `revision` (0: it does not exist).
    pub fn modified(key: impl Into<Vec<u8>>, revision: i64) -> Self {
        Self::new(
            key,
            rpc::compare::CompareResult::Equal,
            rpc::compare::CompareTarget::Mod,
            rpc::compare::TargetUnion::ModRevision(revision),
        )
    }

    /// `key` exists with this value.
    pub fn value_is(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        Self::new(
            key,
            rpc::compare::CompareResult::Equal,
            rpc::compare::CompareTarget::Value,
            rpc::compare::TargetUnion::Value(value.into()),
        )
    }

    /// `key` is attached to this lease.
    pub fn lease_is(key: impl Into<Vec<u8>>, lease: i64) -> Self {
        Self::new(
            key,
            rpc::compare::CompareResult::Equal,
            rpc::compare::CompareTarget::Lease,
            rpc::compare::TargetUnion::Lease(lease),
        )
    }
}

/// An operation of a transaction.
#[derive(Debug, Clone)]
pub struct Op(rpc::RequestOp);

impl Op {
    fn of(request: rpc::request_op::Request) -> Self {
        Op(rpc::RequestOp {
            request: Some(request),
        })
    }

    /// Writes `key` (attached to `lease` unless 0).
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> Self {
        Self::of(rpc::request_op::Request::RequestPut(put_request(
            key, value, lease,
        )))
    }

    /// Reads `key`, or what `range` selects.
    pub fn get(key: impl Into<Vec<u8>>, range: Range) -> Self {
        Self::of(rpc::request_op::Request::RequestRange(
            range.request(key.into()),
        ))
    }

    /// Deletes `key`.
    pub fn delete(key: impl Into<Vec<u8>>) -> Self {
        Self::of(rpc::request_op::Request::RequestDeleteRange(
            delete_request(key),
        ))
    }
}

/// A transaction: if every comparison holds, the `and_then` operations run, else the
/// `or_else` ones, atomically.
#[derive(Debug, Clone, Default)]
pub struct Txn(rpc::TxnRequest);

impl Txn {
    pub fn new() -> Self {
        Txn::default()
    }

    /// Adds comparisons.
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.0.compare.extend(compares.into_iter().map(|c| c.0));
        self
    }

    /// Adds operations run when every comparison holds.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.0.success.extend(ops.into_iter().map(|o| o.0));
        self
    }

    /// Adds operations run when a comparison fails.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.0.failure.extend(ops.into_iter().map(|o| o.0));
        self
    }

    /// How many operations it holds, comparisons included (etcd bounds them with
    /// `--max-txn-ops`, 128 by default).
    pub fn ops(&self) -> usize {
        self.0.compare.len() + self.0.success.len().max(self.0.failure.len())
    }
}

/// What a transaction did.
#[derive(Debug, Clone)]
pub struct TxnResponse(rpc::TxnResponse);

impl TxnResponse {
    /// Whether every comparison held (the `and_then` branch ran).
    pub fn succeeded(&self) -> bool {
        self.0.succeeded
    }

    /// The revision after the transaction.
    pub fn revision(&self) -> i64 {
        revision(self.0.header)
    }

    /// The raft term of the member that answered (0 when the header is missing).
    pub fn raft_term(&self) -> u64 {
        self.0.header.map_or(0, |h| h.raft_term)
    }

    /// The outcome of operation `i` of the branch that ran, when it was a read.
    pub fn range(&self, i: usize) -> Option<&RangeResponse> {
        match self.0.responses.get(i)?.response.as_ref()? {
            rpc::response_op::Response::ResponseRange(r) => Some(r),
            _ => None,
        }
    }

    /// How many keys operation `i` of the branch that ran deleted, when it was a deletion.
    pub fn deleted(&self, i: usize) -> Option<i64> {
        match self.0.responses.get(i)?.response.as_ref()? {
            rpc::response_op::Response::ResponseDeleteRange(r) => Some(r.deleted),
            _ => None,
        }
    }
}

/// The responses of a watch. Dropping it ends the watch.
pub struct WatchStream {
    /// Held so the request half stays open: etcd ends a watch whose client closed it.
    _requests: mpsc::Sender<rpc::WatchRequest>,
    responses: tonic::Streaming<WatchResponse>,
}

impl WatchStream {
    /// The next response; `None` when etcd closed the stream.
    pub async fn message(&mut self) -> Result<Option<WatchResponse>> {
        Ok(self.responses.message().await?)
    }
}

/// A lease's keep-alive stream.
pub struct LeaseKeeper {
    id: i64,
    requests: mpsc::Sender<rpc::LeaseKeepAliveRequest>,
    responses: tonic::Streaming<rpc::LeaseKeepAliveResponse>,
    /// A renewal was asked for and not yet answered.
    asked: bool,
}

impl LeaseKeeper {
    /// Renews the lease once: its remaining TTL in seconds (0: the lease no longer exists),
    /// and the raft term of the member that answered.
    pub async fn renew(&mut self) -> Result<(i64, u64)> {
        if !self.asked {
            self.requests
                .send(rpc::LeaseKeepAliveRequest { id: self.id })
                .await
                .map_err(|_| Error::StreamEnded)?;
            self.asked = true;
        }
        let answer = self.responses.message().await?;
        self.asked = false;
        match answer {
            Some(r) => Ok((r.ttl, r.header.map_or(0, |h| h.raft_term))),
            None => Err(Error::StreamEnded),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_after_its_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"/maru/a/"), b"/maru/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn a_transaction_counts_its_comparisons_and_its_longer_branch() {
        let t = Txn::new()
            .when([Compare::absent("a"), Compare::lease_is("n", 7)])
            .and_then([Op::put("a", "1", 7)])
            .or_else([Op::get("n", Range::KEY), Op::get("a", Range::KEY)]);
        assert_eq!(t.ops(), 4);
    }

    #[tokio::test]
    async fn endpoints_need_a_url_and_at_least_one() {
        let none: [&str; 0] = [];
        assert!(matches!(
            Client::connect(&none, Options::default()),
            Err(Error::NoEndpoint)
        ));
        assert!(matches!(
            Client::connect(&["http://exa mple:1"], Options::default()),
            Err(Error::Endpoint(..))
        ));
    }
}
