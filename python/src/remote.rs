//! [`RemoteCore`]: the core of the remote backend (`MaruConfig(storage_backend="remote")`):
//! a [`RemoteClient`] to a memory node's marud and an [`Arena`], registered staging memory
//! whose pieces are the handler's allocations and the views of what it retrieves. A store
//! WRITEs an allocation's piece into the pool as it is; a retrieve READs the entry into a new
//! piece, which its view keeps until the view goes.
//!
//! Failures of the pool never raise: after one, the client leaves the pool alone for the
//! retry period, and meanwhile lookups answer misses, stores `False`, deletions and pins
//! `False` (the failure that starts the period is logged to the `maru.remote` logger). What
//! the local handler raises for the same request (a refused permission, a bad key, a bad
//! argument) is raised.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use maru_remote::client::Error as RemoteError;
use maru_remote::error_chain as chain;
use maru_remote::{ARENA_ALIGN, Arena, Lease, Purpose, RemoteClient, RemoteConfig, Stored};
use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyMemoryView};

use crate::buffers::PoolBuffer;
use crate::core::{AllocHandle, COPY_ON_STORE_MAX, MemoryInfo, Staging, key_bytes, os_error};

/// The region id of a remote handler's staging buffer: its allocations and retrieved views
/// are pieces of it, `page_index` their offset in `ARENA_ALIGN` pages. Above every local
/// region id (raw pools below 2**32, memfs regions from 2**32).
pub const STAGING_REGION: u64 = 1 << 48;

/// A remote handler's allocation: the piece of its staging buffer and the object `buf` views,
/// until stored or freed.
pub struct Staged {
    state: Mutex<Option<(Arc<Lease>, Py<PoolBuffer>)>>,
}

impl Staging for Staged {
    fn done(&self) -> bool {
        self.state.lock().is_none()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Staged {
    fn lease(&self) -> PyResult<Arc<Lease>> {
        self.state
            .lock()
            .as_ref()
            .map(|(l, _)| l.clone())
            .ok_or_else(|| PyValueError::new_err("this allocation was stored or freed already"))
    }

    /// Ends the handler's use of the allocation (stored or freed): its piece goes back when
    /// nothing views it any more. When `buf` is the only view and the piece is small, `buf`
    /// becomes a view of a copy and the piece goes back now (as a local store gives the
    /// pool's pages up).
    fn finish(&self, py: Python<'_>, h: &AllocHandle) -> PyResult<()> {
        let Some((lease, exporter)) = self.state.lock().take() else {
            return Ok(());
        };
        if lease.len() as u64 <= COPY_ON_STORE_MAX {
            let mut buf = h.buf.lock();
            // `release` refuses while something holds a buffer of the view itself.
            if buf.get_refcnt(py) == 1 && buf.bind(py).call_method0("release").is_ok() {
                if exporter.get().exported() {
                    // Views sliced from `buf` still see the piece: so does a new `buf`.
                    *buf = PoolBuffer::view_of(exporter.bind(py))?;
                } else {
                    let copy = PyByteArray::new_with(py, lease.len(), |b| {
                        lease.copy_to(b);
                        Ok(())
                    })?;
                    *buf = PyMemoryView::from(&copy)?.into_any().unbind();
                }
            }
        }
        drop(exporter);
        drop(lease);
        Ok(())
    }
}

fn staged<'a>(h: &'a Bound<'_, AllocHandle>) -> PyResult<&'a Staged> {
    h.get()
        .staged
        .as_deref()
        .and_then(|s| s.as_any().downcast_ref::<Staged>())
        .ok_or_else(|| {
            PyValueError::new_err(
                "this AllocHandle holds no staging memory (it did not come from this remote \
             handler's alloc())",
            )
        })
}

/// The errno a remote failure stands for.
fn errno_of(e: &RemoteError) -> i32 {
    match e {
        RemoteError::Server(e) => e.errno(),
        RemoteError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::ENOTCONN),
        RemoteError::PoolFull(_) => libc::ENOSPC,
        RemoteError::Unavailable { .. } => libc::EAGAIN,
        RemoteError::InvalidArgument(_) => libc::EINVAL,
        RemoteError::Protocol(_) => libc::EPROTO,
        RemoteError::StaleGeneration => libc::ESTALE,
        RemoteError::Stuck(_) => libc::EBUSY,
        RemoteError::Staging { source, .. } => source.raw_os_error().unwrap_or(libc::ENOMEM),
        RemoteError::Nixl { .. } => libc::EIO,
    }
}

/// A remote failure as the package's exception (`maru.errors.from_native` for its errno).
fn remote_error(e: RemoteError) -> PyErr {
    match e {
        RemoteError::Server(e) => os_error(e),
        RemoteError::InvalidArgument(m) => PyValueError::new_err(m),
        e => {
            let (code, msg) = (errno_of(&e), chain(&e));
            Python::attach(|py| {
                py.import("maru.errors")
                    .and_then(|m| m.getattr("from_native"))
                    .and_then(|f| f.call1((code, msg.as_str())))
                    .map(PyErr::from_value)
                    .unwrap_or_else(|_| PyRuntimeError::new_err(msg))
            })
        }
    }
}

/// Logs to the `maru.remote` logger (Python's logging).
fn log(py: Python<'_>, level: &str, msg: &str) {
    let _ = py
        .import("logging")
        .and_then(|l| l.call_method1("getLogger", ("maru.remote",)))
        .and_then(|l| l.call_method1(level, (msg,)));
}

/// How a failed call answers: raised (what the local handler raises for the same request),
/// or the caller's fallback (a miss, `False`) when the pool failed or is left alone.
fn degrade(py: Python<'_>, what: &str, e: RemoteError) -> PyResult<()> {
    match e {
        RemoteError::Server(maru::Error::NotFound(_)) => Ok(()),
        RemoteError::Server(_) | RemoteError::InvalidArgument(_) => Err(remote_error(e)),
        RemoteError::Unavailable { .. } => Ok(()),
        RemoteError::PoolFull(m) => {
            log(
                py,
                "debug",
                &format!("remote {what}: the pool is full: {m}"),
            );
            Ok(())
        }
        e => {
            log(
                py,
                "warning",
                &format!(
                    "remote {what} failed; the pool is left alone for the retry period \
                     (misses and failed stores meanwhile): {}",
                    chain(&e)
                ),
            );
            Ok(())
        }
    }
}

/// One store's outcome: `True` when stored or present already (write-once), `False` when
/// there is no room or the pool failed; raised as the local handler raises.
fn store_outcome(py: Python<'_>, r: Result<Stored, RemoteError>) -> PyResult<bool> {
    match r {
        Ok(_) | Err(RemoteError::Server(maru::Error::Exists(_))) => Ok(true),
        Err(RemoteError::Server(maru::Error::NoSpace(_) | maru::Error::Quota(_))) => Ok(false),
        Err(e) => degrade(py, "store", e).map(|()| false),
    }
}

/// Entry paths grouped by namespace (a long key's segments nest its entry in namespaces of
/// their own): namespace -> (index, entry name).
fn grouped(paths: &[String]) -> BTreeMap<&str, Vec<(usize, &str)>> {
    let mut out: BTreeMap<&str, Vec<(usize, &str)>> = BTreeMap::new();
    for (i, p) in paths.iter().enumerate() {
        let (ns, name) = split(p);
        out.entry(ns).or_default().push((i, name));
    }
    out
}

/// `ns/name` as `(ns, name)`.
fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

/// A remote handler's connection: a memory node's pool, reached over NIXL, bound to one
/// namespace.
#[pyclass(module = "maru._native", name = "RemoteCore", frozen)]
pub struct RemoteCore {
    client: RwLock<Option<Arc<RemoteClient>>>,
    arena: Arena,
    ns: String,
    chunk: u64,
    url: String,
    /// This handler's pins, counted: entry path -> count. marud's remote door keeps one pin
    /// flag per entry; the handler sets it at a first pin and clears it at the last unpin.
    pins: Mutex<HashMap<String, u32>>,
    /// Whether a load refused for want of staging room was logged.
    warned_room: AtomicBool,
}

impl RemoteCore {
    fn client(&self) -> PyResult<Arc<RemoteClient>> {
        self.client
            .read()
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("Not connected: the handler was closed"))
    }

    fn path(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        Ok(maru::key::path(&self.ns, &key_bytes(key)?))
    }

    fn paths(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let mut out = Vec::with_capacity(keys.len().unwrap_or(0));
        for k in keys.try_iter()? {
            out.push(self.path(&k?)?);
        }
        Ok(out)
    }

    fn info(&self, py: Python<'_>, lease: Lease) -> PyResult<Py<MemoryInfo>> {
        let page_index = (lease.offset() / ARENA_ALIGN) as u64;
        let view = PoolBuffer::of_lease(Arc::new(lease), true).view(py)?;
        Py::new(
            py,
            MemoryInfo {
                view,
                region_id: STAGING_REGION,
                page_index,
            },
        )
    }

    fn no_room(&self, size: u64) -> PyErr {
        let s = self.arena.stats();
        let msg = format!(
            "the staging buffer has no room for {size} bytes outside the load reserve ({} of \
             {} bytes free, {} kept for loads; raise pool_size or lower remote_load_reserve)",
            s.free, s.capacity, s.load_reserve
        );
        Python::attach(|py| {
            py.import("maru.errors")
                .and_then(|m| m.getattr("StagingFullError"))
                .and_then(|c| c.call1((libc::ENOSPC, msg.as_str())))
                .map(PyErr::from_value)
                .unwrap_or_else(|_| os_error(maru::Error::NoSpace(msg.clone())))
        })
    }

    /// Pins (`pin`) or unpins one entry per path in marud, grouped by namespace: per path,
    /// `Ok(true)` when done, `Ok(false)` when the entry is missing or the pool failed.
    fn set_pins(&self, py: Python<'_>, paths: &[String], pin: bool) -> PyResult<Vec<bool>> {
        let c = self.client()?;
        let mut out = vec![false; paths.len()];
        for (ns, items) in grouped(paths) {
            let names: Vec<&str> = items.iter().map(|&(_, n)| n).collect();
            match py.detach(|| c.pin(ns, &names, pin)) {
                Ok(each) => {
                    for (&(i, _), r) in items.iter().zip(each) {
                        match r {
                            Ok(()) => out[i] = true,
                            Err(e) => degrade(py, "pin", e)?,
                        }
                    }
                }
                Err(e) => degrade(py, "pin", e)?,
            }
        }
        Ok(out)
    }
}

#[pymethods]
impl RemoteCore {
    #[new]
    #[pyo3(signature = (url, token, node, namespace, timeout_ms, transfer_timeout_s, retry_s, staging_bytes, chunk_size, load_reserve, ucx_device = None, create_namespace = true, namespace_mode = 0o755))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: String,
        token: String,
        node: String,
        namespace: String,
        timeout_ms: u64,
        transfer_timeout_s: f64,
        retry_s: f64,
        staging_bytes: u64,
        chunk_size: u64,
        load_reserve: f64,
        ucx_device: Option<String>,
        create_namespace: bool,
        namespace_mode: u32,
    ) -> PyResult<Self> {
        if chunk_size == 0 {
            return Err(PyValueError::new_err("chunk_size must be positive"));
        }
        if !(0.0..1.0).contains(&load_reserve) {
            return Err(PyValueError::new_err(
                "remote_load_reserve must be in [0, 1)",
            ));
        }
        let seconds = |name: &str, s: f64| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| PyValueError::new_err(format!("{name} must be a positive number")))
        };
        let transfer_timeout = seconds("remote_transfer_timeout_s", transfer_timeout_s)?;
        let retry = seconds("remote_retry_s", retry_s)?;
        let staging = usize::try_from(staging_bytes)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                PyValueError::new_err("pool_size (the staging buffer) must be positive")
            })?;
        let ns = namespace.trim_matches('/').to_owned();
        maru::name::split_ns(&ns).map_err(os_error)?;
        let cfg = RemoteConfig {
            url: url.clone(),
            token,
            node,
            ucx_device: ucx_device.filter(|d| !d.trim().is_empty()),
            transfer_timeout,
            retry,
            // The handler moves bytes through its arena; the client's own staging buffer
            // serves only its copying calls, which the handler does not make.
            staging_bytes: ARENA_ALIGN as u64,
            control_timeout: Duration::from_millis(timeout_ms.max(1)),
        };
        let reserve = (staging as f64 * load_reserve) as usize;
        let (client, arena) = py
            .detach(|| -> Result<_, RemoteError> {
                let client = RemoteClient::connect(cfg)?;
                if create_namespace {
                    client.mkdir(&ns, namespace_mode)?;
                }
                let arena = client.arena(staging, reserve)?;
                Ok((client, arena))
            })
            .map_err(remote_error)?;
        Ok(RemoteCore {
            client: RwLock::new(Some(Arc::new(client))),
            arena,
            ns,
            chunk: chunk_size,
            url,
            pins: Mutex::new(HashMap::new()),
            warned_room: AtomicBool::new(false),
        })
    }

    /// Gives back this handler's pins (when the pool answers), then closes the connection.
    /// Views already handed out stay valid until they go.
    fn close(&self, py: Python<'_>) {
        let pinned: Vec<String> = self.pins.lock().drain().map(|(p, _)| p).collect();
        if !pinned.is_empty() && self.client.read().is_some() {
            let _ = self.set_pins(py, &pinned, false);
        }
        let c = self.client.write().take();
        py.detach(move || drop(c));
    }

    #[getter]
    fn connected(&self) -> bool {
        self.client.read().is_some()
    }

    #[getter]
    fn namespace(&self) -> &str {
        &self.ns
    }

    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// The key's entry path on the memory node, relative to its mount (`namespace/name`).
    fn entry_path(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        self.path(key)
    }

    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let keys = PyList::new(py, [key])?;
        Ok(self.batch_exists(py, keys.as_any())?[0])
    }

    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let (c, ps) = (self.client()?, self.paths(keys)?);
        let mut out = vec![false; ps.len()];
        for (ns, items) in grouped(&ps) {
            let names: Vec<&str> = items.iter().map(|&(_, n)| n).collect();
            match py.detach(|| c.batch_exists(ns, &names)) {
                Ok(v) => {
                    for (&(i, _), there) in items.iter().zip(v) {
                        out[i] = there;
                    }
                }
                Err(e) => degrade(py, "exists", e)?,
            }
        }
        Ok(out)
    }

    fn retrieve(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Py<MemoryInfo>>> {
        let keys = PyList::new(py, [key])?;
        let got = self.batch_retrieve(py, keys.as_any())?;
        Ok(got.get_item(0)?.extract()?)
    }

    /// The entries of `keys`: each read into a piece of the staging buffer, which its
    /// `MemoryInfo.view` keeps until the view goes. `None` for a missing key, for an entry no
    /// free piece fits (counted: `load_refused`), and while the pool is left alone.
    fn batch_retrieve<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (c, ps) = (self.client()?, self.paths(keys)?);
        let refused = self.arena.stats().load_refused;
        let mut leases: Vec<Option<Lease>> = Vec::new();
        leases.resize_with(ps.len(), || None);
        for (ns, items) in grouped(&ps) {
            let names: Vec<&str> = items.iter().map(|&(_, n)| n).collect();
            match py.detach(|| c.retrieve_leased(ns, &names, &self.arena)) {
                Ok(got) => {
                    for (&(i, _), l) in items.iter().zip(got) {
                        leases[i] = l;
                    }
                }
                Err(e) => degrade(py, "retrieve", e)?,
            }
        }
        if self.arena.stats().load_refused > refused
            && !self.warned_room.swap(true, Ordering::Relaxed)
        {
            let s = self.arena.stats();
            log(
                py,
                "warning",
                &format!(
                    "remote retrieve: entries found in the pool are answered as misses: the \
                     staging buffer has no room for them ({} of {} bytes free; retrieved views \
                     and stored allocations hold the rest until they go). Raise pool_size. \
                     (Logged once; counted in get_stats()['remote_storage']['staging'])",
                    s.free, s.capacity
                ),
            );
        }
        let out = PyList::empty(py);
        for l in leases {
            match l {
                Some(l) => out.append(self.info(py, l)?)?,
                None => out.append(py.None())?,
            }
        }
        Ok(out)
    }

    /// A piece of the staging buffer to write, then store; never within the load reserve.
    #[pyo3(signature = (size, within_chunk = true))]
    fn alloc(&self, py: Python<'_>, size: i64, within_chunk: bool) -> PyResult<Py<AllocHandle>> {
        if size <= 0 {
            return Err(PyValueError::new_err(format!(
                "allocation size must be positive, got {size}"
            )));
        }
        let size = size as u64;
        if within_chunk && size > self.chunk {
            return Err(PyValueError::new_err(format!(
                "Requested size {size} exceeds chunk_size {} (raise MaruConfig.chunk_size_bytes)",
                self.chunk
            )));
        }
        self.client()?;
        let lease = usize::try_from(size)
            .ok()
            .and_then(|n| self.arena.lease(n, Purpose::Store))
            .ok_or_else(|| self.no_room(size))?;
        let page_index = (lease.offset() / ARENA_ALIGN) as u64;
        let lease = Arc::new(lease);
        let exporter = Bound::new(py, PoolBuffer::of_lease(lease.clone(), false))?;
        let buf = PoolBuffer::view_of(&exporter)?;
        Py::new(
            py,
            AllocHandle {
                buf: Mutex::new(buf),
                region_id: STAGING_REGION,
                page_index,
                size,
                held: None,
                staged: Some(Box::new(Staged {
                    state: Mutex::new(Some((lease, exporter.unbind()))),
                })),
            },
        )
    }

    /// Stores `handle`'s bytes under `key`: one WRITE from its piece, then publication. True
    /// when stored or present already (write-once); False when the pool has no room or
    /// failed. The handle is done either way.
    #[pyo3(signature = (key, handle, length = None))]
    fn store(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        handle: &Bound<'_, AllocHandle>,
        length: Option<u64>,
    ) -> PyResult<bool> {
        let keys = PyList::new(py, [key])?;
        let handles = PyList::new(py, [handle])?;
        let lengths = length.map(|l| vec![l]);
        Ok(self.store_many(py, keys.as_any(), handles.as_any(), lengths)?[0])
    }

    fn batch_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        self.store_many(py, keys, handles, None)
    }

    /// Stores a copy of `views` (byte memoryviews, concatenated) under `key`: a piece of the
    /// staging buffer, the copy, and its store. Returns as `store`.
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        views: Vec<pyo3::buffer::PyBuffer<u8>>,
    ) -> PyResult<bool> {
        let (c, p) = (self.client()?, self.path(key)?);
        let size: usize = views.iter().map(pyo3::buffer::PyBuffer::len_bytes).sum();
        if size == 0 {
            return Err(PyValueError::new_err(
                "an empty value is not stored in a remote pool",
            ));
        }
        let mut lease = self
            .arena
            .lease(size, Purpose::Store)
            .ok_or_else(|| self.no_room(size as u64))?;
        crate::buffers::gather(py, &views, &mut lease.bytes_mut()[..size])?;
        let (ns, name) = split(&p);
        let r = py.detach(|| c.store_leased(ns, &[(name, &lease, size)]));
        let r = r.and_then(|mut v| {
            v.pop()
                .unwrap_or_else(|| Err(RemoteError::Protocol("no outcome".into())))
        });
        store_outcome(py, r)
    }

    /// Gives an unstored allocation back.
    fn free(&self, py: Python<'_>, handle: &Bound<'_, AllocHandle>) -> PyResult<()> {
        let s = staged(handle)?;
        if s.done() {
            return Err(PyValueError::new_err(
                "this allocation was stored or freed already",
            ));
        }
        s.finish(py, handle.get())
    }

    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let keys = PyList::new(py, [key])?;
        Ok(self.batch_delete(py, keys.as_any())?[0])
    }

    /// Deletes entries: per key, True when deleted, False when missing or the pool failed.
    fn batch_delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let (c, ps) = (self.client()?, self.paths(keys)?);
        let mut out = vec![false; ps.len()];
        for (ns, items) in grouped(&ps) {
            let names: Vec<&str> = items.iter().map(|&(_, n)| n).collect();
            match py.detach(|| c.delete(ns, &names)) {
                Ok(each) => {
                    for (&(i, _), r) in items.iter().zip(each) {
                        match r {
                            Ok(()) => out[i] = true,
                            Err(e) => degrade(py, "delete", e)?,
                        }
                    }
                }
                Err(e) => degrade(py, "delete", e)?,
            }
        }
        // A deleted entry's pin went with it.
        let mut pins = self.pins.lock();
        for (p, _) in ps.iter().zip(&out).filter(|(_, d)| **d) {
            pins.remove(p);
        }
        Ok(out)
    }

    fn hold(&self, py: Python<'_>, key: &Bound<'_, PyAny>, hold: bool) -> PyResult<bool> {
        let keys = PyList::new(py, [key])?;
        Ok(self.batch_hold(py, keys.as_any(), hold)?[0])
    }

    /// Takes (`hold`) or gives back one of this handler's pins on each key. The first pin of
    /// an entry sets marud's pin flag, the last unpin clears it; an unpin of a key this
    /// handler holds no pin on is False and sends nothing.
    fn batch_hold(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        hold: bool,
    ) -> PyResult<Vec<bool>> {
        let ps = self.paths(keys)?;
        if hold {
            let out = self.set_pins(py, &ps, true)?;
            let mut pins = self.pins.lock();
            for (p, _) in ps.iter().zip(&out).filter(|(_, ok)| **ok) {
                *pins.entry(p.clone()).or_default() += 1;
            }
            return Ok(out);
        }
        // Pins given back in this call per path (a path may come twice).
        let mut out = vec![false; ps.len()];
        let mut last = Vec::new();
        {
            let mut pins = self.pins.lock();
            for (i, p) in ps.iter().enumerate() {
                match pins.get_mut(p) {
                    Some(n) if *n > 1 => {
                        *n -= 1;
                        out[i] = true;
                    }
                    Some(_) => {
                        pins.remove(p);
                        last.push(i);
                    }
                    None => {}
                }
            }
        }
        if last.is_empty() {
            return Ok(out);
        }
        let paths: Vec<String> = last.iter().map(|&i| ps[i].clone()).collect();
        let cleared = self.set_pins(py, &paths, false)?;
        let mut pins = self.pins.lock();
        for (&i, ok) in last.iter().zip(cleared) {
            out[i] = ok;
            if !ok {
                // Still pinned in marud (the pool failed): kept, for a later unpin or close.
                pins.entry(ps[i].clone()).or_insert(1);
            }
        }
        Ok(out)
    }

    /// The handler's counters, staging buffer and state, as JSON.
    fn stats_json(&self) -> PyResult<String> {
        let c = self.client()?;
        let s = c.stats();
        let a = self.arena.stats();
        let until = c
            .unavailable_until()
            .map(|u| u.saturating_duration_since(Instant::now()).as_secs_f64());
        let v = serde_json::json!({
            "url": self.url,
            "agent": c.agent_name(),
            "namespace": self.ns,
            "unavailable_for_s": until,
            "pins": self.pins.lock().len(),
            "counters": {
                "requests": s.requests,
                "transfers": s.transfers,
                "bytes_written": s.bytes_written,
                "bytes_read": s.bytes_read,
                "errors": s.errors,
                "reconnects": s.reconnects,
                "skipped": s.skipped,
                "lingering": s.lingering,
            },
            "staging": {
                "capacity": a.capacity,
                "free": a.free,
                "load_reserve": a.load_reserve,
                "leases": a.leases,
                "store_refused": a.store_refused,
                "load_refused": a.load_refused,
            },
        });
        serde_json::to_string(&v).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// No local pools: `[]`.
    fn pools_json(&self) -> &str {
        "[]"
    }

    /// True if marud answers (False while the pool is left alone).
    fn healthcheck(&self, py: Python<'_>) -> bool {
        self.client().is_ok_and(|c| py.detach(|| c.ping()).is_ok())
    }

    /// No raw pool is mapped here: `None`.
    fn pool_view(&self, _pool: u32) -> Option<Py<PyAny>> {
        None
    }

    /// The keys of the namespace (as bytes), long ones included; empty while the pool is
    /// left alone.
    fn list_keys(&self, py: Python<'_>) -> PyResult<Vec<Py<PyBytes>>> {
        let c = self.client()?;
        let names = match py.detach(|| list_names(&c, &self.ns, "")) {
            Ok(n) => n,
            Err(e) => {
                degrade(py, "list", e)?;
                Vec::new()
            }
        };
        names
            .into_iter()
            .map(|n| {
                maru::key::decode(&n)
                    .map(|k| PyBytes::new(py, &k).unbind())
                    .map_err(os_error)
            })
            .collect()
    }
}

impl RemoteCore {
    /// Stores `handles` under `keys` (with `lengths`, or each handle's size): every handle is
    /// checked before anything moves, then done whatever the outcome.
    fn store_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        lengths: Option<Vec<u64>>,
    ) -> PyResult<Vec<bool>> {
        let (c, ps) = (self.client()?, self.paths(keys)?);
        let mut hs: Vec<Bound<'_, AllocHandle>> = Vec::with_capacity(ps.len());
        for x in handles.try_iter()? {
            hs.push(x?.cast_into::<AllocHandle>()?);
        }
        if hs.len() != ps.len() {
            return Err(PyValueError::new_err(
                "keys and handles must have the same length",
            ));
        }
        let mut leases: Vec<(Arc<Lease>, usize)> = Vec::with_capacity(hs.len());
        for (i, h) in hs.iter().enumerate() {
            let lease = staged(h)?.lease()?;
            if !self.arena.holds(&lease) {
                return Err(PyValueError::new_err(
                    "this AllocHandle is an allocation of another handler",
                ));
            }
            if leases.iter().any(|(l, _)| Arc::ptr_eq(l, &lease)) {
                return Err(PyValueError::new_err("the same handle appears twice"));
            }
            let len = lengths.as_ref().map_or(h.get().size, |l| l[i]);
            if len == 0 || len > lease.len() as u64 {
                return Err(PyValueError::new_err(format!(
                    "a length of {len} bytes for an allocation of {}",
                    lease.len()
                )));
            }
            leases.push((lease, len as usize));
        }
        let mut outcomes: Vec<Option<Result<Stored, RemoteError>>> = Vec::new();
        outcomes.resize_with(ps.len(), || None);
        let mut failed: Option<RemoteError> = None;
        for (ns, items) in grouped(&ps) {
            let batch: Vec<(&str, &Lease, usize)> = items
                .iter()
                .map(|&(i, name)| (name, &*leases[i].0, leases[i].1))
                .collect();
            match py.detach(|| c.store_leased(ns, &batch)) {
                Ok(v) => {
                    for (&(i, _), r) in items.iter().zip(v) {
                        outcomes[i] = Some(r);
                    }
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        drop(leases);
        // Done, stored or not (as a refused local store frees its allocation).
        for h in &hs {
            if let Ok(s) = staged(h) {
                s.finish(py, h.get())?;
            }
        }
        if let Some(e) = failed {
            store_outcome(py, Err(e))?;
        }
        outcomes
            .into_iter()
            .map(|r| r.map_or(Ok(false), |r| store_outcome(py, r)))
            .collect()
    }
}

/// Entry names under `ns`, relative to the handler's namespace (`prefix` + name), following
/// long keys' segment namespaces.
fn list_names(c: &RemoteClient, ns: &str, prefix: &str) -> Result<Vec<String>, RemoteError> {
    let listing = c.list(ns)?;
    let mut out: Vec<String> = listing
        .entries
        .into_iter()
        .map(|e| format!("{prefix}{}", e.key))
        .collect();
    for child in listing.children {
        if child.ends_with(maru::key::CONTINUED) {
            out.extend(list_names(
                c,
                &format!("{ns}/{child}"),
                &format!("{prefix}{child}/"),
            )?);
        }
    }
    Ok(out)
}
