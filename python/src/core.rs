//! [`Core`]: one connection to marud bound to a namespace, with the store's verbs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use maru::{AfterPublish, Error};
use parking_lot::{Mutex, RwLock};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString};

use crate::buffers::PoolBuffer;

/// Region ids of memfs entries and allocations start here (each is a file, a region of
/// its own, named by its generation or allocation id); below it, a region id is a raw
/// pool's id (the device the original design carved regions from).
pub const MEMFS_REGION_BASE: u64 = 1 << 32;

/// Bytes per page of a raw pool's region: the pool's allocation unit, so a page index names
/// an entry's offset exactly.
pub const RAW_PAGE_SIZE: u64 = 4096;

/// A libmaru error as the package's exception for its errno (`maru.errors.from_native`),
/// or a plain `OSError(errno, message)` if that cannot be built.
pub fn os_error(e: Error) -> PyErr {
    let (code, msg) = (e.errno(), e.to_string());
    Python::attach(|py| {
        py.import("maru.errors")
            .and_then(|m| m.getattr("from_native"))
            .and_then(|f| f.call1((code, msg.as_str())))
            .map(PyErr::from_value)
            .unwrap_or_else(|_| PyOSError::new_err((code, msg)))
    })
}

/// A key's bytes: `str` as UTF-8, `bytes` as they are, `int` as its decimal digits.
pub fn key_bytes(key: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = key.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = key.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if key.is_instance_of::<PyInt>() {
        return Ok(match key.extract::<i128>() {
            Ok(v) => v.to_string().into_bytes(),
            Err(_) => key
                .call_method0("__index__")?
                .str()?
                .to_str()?
                .as_bytes()
                .to_vec(),
        });
    }
    Err(PyTypeError::new_err(format!(
        "a key is str, bytes or int, not {}",
        key.get_type().name()?
    )))
}

/// An allocation from [`Core::alloc`] (or built by hand, as the original's dataclass can be;
/// such a handle holds no pool memory and cannot be stored).
#[pyclass(module = "maru._native", name = "AllocHandle", frozen, weakref)]
pub struct AllocHandle {
    /// A view of the pool memory; after a store that gave the pool's pages up (see
    /// [`AllocHandle::after_store`]), of a copy of it.
    pub(crate) buf: Mutex<Py<PyAny>>,
    pub(crate) region_id: u64,
    pub(crate) page_index: u64,
    pub(crate) size: u64,
    /// The pool memory, the connection it belongs to, and the object `buf` views.
    pub(crate) held: Option<(Arc<Mutex<maru::AllocHandle>>, usize, Py<PoolBuffer>)>,
    /// A remote handler's allocation instead: a piece of its registered staging buffer (the
    /// remote core's, which alone knows its type).
    pub(crate) staged: Option<Box<dyn Staging>>,
}

/// A remote handler's allocation, as its handle sees it.
pub(crate) trait Staging: Send + Sync {
    /// True once stored or freed.
    fn done(&self) -> bool;
    /// For the remote core, which takes back its own type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Most bytes a store copies for `buf` to give the pool's pages up with no system call (a
/// private mapping of them costs one, on these machines more than copying this much).
pub(crate) const COPY_ON_STORE_MAX: u64 = 64 << 10;

impl AllocHandle {
    /// What a store of this handle leaves of its bytes. When nothing but `buf` can reach them
    /// (no other reference to it or to the object it views, no view sliced from it, no object
    /// built on it) and they are few, `buf` is released and replaced by a view of a copy, and
    /// the pool's pages are simply let go of; otherwise they become a private copy-on-write
    /// mapping at the same address, which every view keeps seeing.
    fn after_store(&self, py: Python<'_>) -> PyResult<AfterPublish> {
        let Some((a, _, exporter)) = &self.held else {
            return Ok(AfterPublish::PrivateCopy);
        };
        let a = a.lock();
        if a.is_done() || self.size > COPY_ON_STORE_MAX {
            return Ok(AfterPublish::PrivateCopy);
        }
        let mut buf = self.buf.lock();
        // `release` refuses while something holds a buffer of the view itself.
        if buf.get_refcnt(py) != 1 || buf.bind(py).call_method0("release").is_err() {
            return Ok(AfterPublish::PrivateCopy);
        }
        // Views sliced from `buf` still see the pool's pages; an exporter referenced elsewhere
        // (`buf.obj`, kept) may yet be viewed, and its views must see them too: they get the
        // private copy, and so does a new view for `buf`.
        if exporter.get().exported() || exporter.get_refcnt(py) != 1 {
            *buf = PoolBuffer::view_of(exporter.bind(py))?;
            return Ok(AfterPublish::PrivateCopy);
        }
        let copy = PyByteArray::new(py, a.as_slice());
        *buf = PyMemoryView::from(&copy)?.into_any().unbind();
        Ok(AfterPublish::Nothing)
    }

    /// After a store that [`after_store`](Self::after_store) prepared: where the publication
    /// failed before it let go of the bytes (a bad length, a namespace that cannot be made),
    /// the handle is still the caller's, and `buf` views the pool's pages again.
    fn stored(&self, py: Python<'_>, after: AfterPublish) -> PyResult<()> {
        if let (AfterPublish::Nothing, Some((a, _, exporter))) = (after, &self.held)
            && !a.lock().is_done()
        {
            *self.buf.lock() = PoolBuffer::view_of(exporter.bind(py))?;
        }
        Ok(())
    }
}

#[pymethods]
impl AllocHandle {
    #[new]
    #[pyo3(signature = (buf, _region_id = 0, _page_index = 0, _size = None))]
    fn new(
        buf: Py<PyAny>,
        _region_id: u64,
        _page_index: u64,
        _size: Option<u64>,
        py: Python<'_>,
    ) -> PyResult<Self> {
        let size = match _size {
            Some(s) => s,
            None => buf.bind(py).len()? as u64,
        };
        Ok(AllocHandle {
            buf: Mutex::new(buf),
            region_id: _region_id,
            page_index: _page_index,
            size,
            held: None,
            staged: None,
        })
    }

    /// Writable pool memory (a `memoryview`): write the value here, then `store` it.
    #[getter]
    fn buf(&self, py: Python<'_>) -> Py<PyAny> {
        self.buf.lock().clone_ref(py)
    }

    /// The region the allocation lives in (a raw pool's id, or
    /// `MEMFS_REGION_BASE + id` for a memfs allocation, a file of its own).
    #[getter]
    fn region_id(&self) -> u64 {
        self.region_id
    }

    #[getter]
    fn _region_id(&self) -> u64 {
        self.region_id
    }

    /// Index of the allocation's first page in its region (raw pools: its offset in the pool
    /// divided by `RAW_PAGE_SIZE`; memfs allocations, regions of their own: 0).
    #[getter]
    fn page_index(&self) -> u64 {
        self.page_index
    }

    #[getter]
    fn _page_index(&self) -> u64 {
        self.page_index
    }

    /// The requested size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    #[getter]
    fn _size(&self) -> u64 {
        self.size
    }

    /// True once stored or freed (its `buf` is then this process's private copy).
    #[getter]
    fn done(&self) -> bool {
        if let Some(s) = &self.staged {
            return s.done();
        }
        self.held
            .as_ref()
            .is_none_or(|(h, _, _)| h.lock().is_done())
    }

    fn __repr__(&self) -> String {
        format!(
            "AllocHandle(region_id={}, page_index={}, size={}, done={})",
            self.region_id,
            self.page_index,
            self.size,
            self.done()
        )
    }
}

/// A retrieved entry: `view` is a read-only `memoryview` of the pool's own pages.
#[pyclass(module = "maru._native", name = "MemoryInfo", get_all, set_all)]
pub struct MemoryInfo {
    pub(crate) view: Py<PyAny>,
    pub(crate) region_id: u64,
    pub(crate) page_index: u64,
}

#[pymethods]
impl MemoryInfo {
    #[new]
    #[pyo3(signature = (view, region_id = 0, page_index = 0))]
    fn new(view: Py<PyAny>, region_id: u64, page_index: u64) -> Self {
        MemoryInfo {
            view,
            region_id,
            page_index,
        }
    }

    /// Lets go of the entry's memory now rather than when this object is collected: `view`
    /// is released (a view something still exports, a slice of it or a tensor over it, stays
    /// valid and keeps the memory). What the original design's remote leases call `release`.
    fn release(&self, py: Python<'_>) {
        let _ = self.view.bind(py).call_method0("release");
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        // A released view has no length.
        let view = match self.view.bind(py).len() {
            Ok(n) => format!("{n} bytes"),
            Err(_) => "released".to_owned(),
        };
        Ok(format!(
            "MemoryInfo(view=<{view}>, region_id={}, page_index={})",
            self.region_id, self.page_index
        ))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>, py: Python<'_>) -> PyResult<bool> {
        let Ok(o) = other.cast::<MemoryInfo>() else {
            return Ok(false);
        };
        let o = o.borrow();
        Ok(self.region_id == o.region_id
            && self.page_index == o.page_index
            && self.view.bind(py).eq(o.view.bind(py))?)
    }
}

/// One connection to marud, bound to one namespace.
#[pyclass(module = "maru._native", name = "Core", frozen)]
pub struct Core {
    h: RwLock<Option<Arc<maru::Handler>>>,
    ns: String,
    chunk: u64,
    /// Per pool id: true for raw pools (regions are pools), false for memfs pools.
    raw: Vec<bool>,
    pools_json: String,
}

fn ok_or_absent(r: maru::Result<()>) -> PyResult<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(Error::NotFound(_)) => Ok(false),
        Err(e) => Err(os_error(e)),
    }
}

impl Core {
    fn handler(&self) -> PyResult<Arc<maru::Handler>> {
        self.h
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

    /// Region and page of a pool location.
    fn region(&self, pool: u32, offset: u64, id: u64) -> (u64, u64) {
        if self.raw.get(pool as usize).copied().unwrap_or(false) {
            (u64::from(pool), offset / RAW_PAGE_SIZE)
        } else {
            (MEMFS_REGION_BASE + id, 0)
        }
    }

    fn info(&self, py: Python<'_>, m: maru::Mapping) -> PyResult<Py<MemoryInfo>> {
        let (region_id, page_index) = self.region(m.pool(), m.offset(), m.generation());
        let view = PoolBuffer::of_mapping(m).view(py)?;
        Py::new(
            py,
            MemoryInfo {
                view,
                region_id,
                page_index,
            },
        )
    }

    fn held(h: &Bound<'_, AllocHandle>) -> PyResult<Arc<Mutex<maru::AllocHandle>>> {
        h.get()
            .held
            .as_ref()
            .map(|(a, _, _)| a.clone())
            .ok_or_else(|| {
                PyValueError::new_err(
                    "this AllocHandle holds no pool memory (it did not come from alloc())",
                )
            })
    }
}

fn publish_outcome(r: maru::Result<()>) -> PyResult<bool> {
    match r {
        // Write-once: the first writer wins; the loser's allocation is freed (as the original).
        Ok(()) | Err(Error::Exists(_)) => Ok(true),
        Err(Error::NoSpace(_) | Error::Quota(_)) => Ok(false),
        Err(e) => Err(os_error(e)),
    }
}

#[pymethods]
impl Core {
    #[new]
    #[pyo3(signature = (socket, namespace, client_name, timeout_ms, chunk_size, create_namespace = true, namespace_mode = 0o755))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        socket: PathBuf,
        namespace: String,
        client_name: String,
        timeout_ms: u64,
        chunk_size: u64,
        create_namespace: bool,
        namespace_mode: u32,
    ) -> PyResult<Self> {
        if chunk_size == 0 {
            return Err(PyValueError::new_err("chunk_size must be positive"));
        }
        let ns = namespace.trim_matches('/').to_owned();
        maru::name::split_ns(&ns).map_err(os_error)?;
        let h = py
            .detach(|| -> maru::Result<maru::Handler> {
                let h = maru::Handler::connect(maru::Config {
                    socket,
                    client_name,
                    timeout: Duration::from_millis(timeout_ms.max(1)),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                })?;
                if create_namespace {
                    let mut at = String::new();
                    for part in ns.split('/') {
                        if !at.is_empty() {
                            at.push('/');
                        }
                        at.push_str(part);
                        match h.mkdir(&at, namespace_mode) {
                            Ok(()) | Err(Error::Exists(_)) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(h)
            })
            .map_err(os_error)?;
        let pools = h.pools();
        let mut raw = Vec::new();
        for p in &pools {
            let i = p.id as usize;
            if raw.len() <= i {
                raw.resize(i + 1, false);
            }
            raw[i] = p.kind != maru::proto::PoolKind::Memfs;
        }
        Ok(Core {
            h: RwLock::new(Some(Arc::new(h))),
            ns,
            chunk: chunk_size,
            raw,
            pools_json: serde_json::to_string(&pools).unwrap_or_default(),
        })
    }

    /// Closes the connection (marud frees what it did not publish, drops its holds).
    /// Mappings already handed out stay valid until their last view goes.
    fn close(&self, py: Python<'_>) {
        let h = self.h.write().take();
        py.detach(move || drop(h));
    }

    #[getter]
    fn connected(&self) -> bool {
        self.h.read().is_some()
    }

    #[getter]
    fn namespace(&self) -> &str {
        &self.ns
    }

    /// The key's entry path, relative to the mount (`namespace/name`).
    fn entry_path(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        self.path(key)
    }

    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (h, p) = (self.handler()?, self.path(key)?);
        py.detach(|| h.exists(&p)).map_err(os_error)
    }

    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let (h, ps) = (self.handler()?, self.paths(keys)?);
        let refs: Vec<&str> = ps.iter().map(String::as_str).collect();
        py.detach(|| h.batch_exists(&refs)).map_err(os_error)
    }

    fn retrieve(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Py<MemoryInfo>>> {
        let (h, p) = (self.handler()?, self.path(key)?);
        match py.detach(|| h.retrieve(&p)).map_err(os_error)? {
            Some(m) => self.info(py, m).map(Some),
            None => Ok(None),
        }
    }

    fn batch_retrieve<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (h, ps) = (self.handler()?, self.paths(keys)?);
        let refs: Vec<&str> = ps.iter().map(String::as_str).collect();
        let maps = py.detach(|| h.batch_retrieve(&refs)).map_err(os_error)?;
        let out = PyList::empty(py);
        for m in maps {
            match m {
                Some(m) => out.append(self.info(py, m)?)?,
                None => out.append(py.None())?,
            }
        }
        Ok(out)
    }

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
        let h = self.handler()?;
        let a = py.detach(|| h.alloc(size)).map_err(os_error)?;
        let (region_id, page_index) = self.region(a.pool(), a.offset(), a.id());
        let a = Arc::new(Mutex::new(a));
        let exporter = Bound::new(py, PoolBuffer::of_alloc(&a))?;
        let buf = PoolBuffer::view_of(&exporter)?;
        Py::new(
            py,
            AllocHandle {
                buf: Mutex::new(buf),
                region_id,
                page_index,
                size,
                held: Some((a, Arc::as_ptr(&h) as usize, exporter.unbind())),
                staged: None,
            },
        )
    }

    /// `count` allocations of `size` bytes in one exchange with marud (no `chunk_size` limit):
    /// for batches of entries larger than the sizes `alloc` gets in batches. All or none.
    fn alloc_many<'py>(
        &self,
        py: Python<'py>,
        size: i64,
        count: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        if size <= 0 {
            return Err(PyValueError::new_err(format!(
                "allocation size must be positive, got {size}"
            )));
        }
        let size = size as u64;
        let h = self.handler()?;
        let allocs = py.detach(|| h.alloc_many(size, count)).map_err(os_error)?;
        let out = PyList::empty(py);
        for a in allocs {
            let (region_id, page_index) = self.region(a.pool(), a.offset(), a.id());
            let a = Arc::new(Mutex::new(a));
            let exporter = Bound::new(py, PoolBuffer::of_alloc(&a))?;
            let buf = PoolBuffer::view_of(&exporter)?;
            out.append(Py::new(
                py,
                AllocHandle {
                    buf: Mutex::new(buf),
                    region_id,
                    page_index,
                    size,
                    held: Some((a, Arc::as_ptr(&h) as usize, exporter.unbind())),
                    staged: None,
                },
            )?)?;
        }
        Ok(out)
    }

    /// Publishes `handle` under `key`. True when stored, or when the key already exists (the
    /// handle is then freed: entries are write-once); False when the pool or the namespace's
    /// quota has no room.
    #[pyo3(signature = (key, handle, length = None))]
    fn store(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        handle: &Bound<'_, AllocHandle>,
        length: Option<u64>,
    ) -> PyResult<bool> {
        let (h, p) = (self.handler()?, self.path(key)?);
        let a = Self::held(handle)?;
        let len = length.unwrap_or(handle.get().size);
        let after = handle.get().after_store(py)?;
        let r = py.detach(|| h.publish_then(&p, &mut a.lock(), Some(len), after));
        handle.get().stored(py, after)?;
        publish_outcome(r)
    }

    /// Stores a copy of `views` (byte memoryviews, concatenated) under `key`: one allocation,
    /// the copy, and its publication, keeping no private copy (Python never sees the
    /// allocation). Returns as `store`.
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        views: Vec<PyBuffer<u8>>,
    ) -> PyResult<bool> {
        let (h, p) = (self.handler()?, self.path(key)?);
        let size: usize = views.iter().map(PyBuffer::len_bytes).sum();
        let mut a = py
            .detach(|| h.alloc(size.max(1) as u64))
            .map_err(os_error)?;
        if let Err(e) = crate::buffers::gather(py, &views, &mut a.as_mut_slice()[..size]) {
            py.detach(|| h.free(a)).map_err(os_error)?;
            return Err(e);
        }
        publish_outcome(py.detach(|| h.store_len(&p, a, Some(size as u64))))
    }

    fn batch_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let (h, ps) = (self.handler()?, self.paths(keys)?);
        let mut hs: Vec<Bound<'_, AllocHandle>> = Vec::with_capacity(ps.len());
        for x in handles.try_iter()? {
            hs.push(x?.cast_into::<AllocHandle>()?);
        }
        if hs.len() != ps.len() {
            return Err(PyValueError::new_err(
                "keys and handles must have the same length",
            ));
        }
        let mut held = Vec::with_capacity(hs.len());
        for x in &hs {
            let a = Self::held(x)?;
            if held.iter().any(|(b, _)| Arc::ptr_eq(&a, b)) {
                return Err(PyValueError::new_err("the same handle appears twice"));
            }
            held.push((a, AfterPublish::PrivateCopy));
        }
        // Every check passed: now the views may be given up.
        for ((_, after), x) in held.iter_mut().zip(&hs) {
            *after = x.get().after_store(py)?;
        }
        let r = py.detach(|| {
            let mut guards: Vec<_> = held.iter().map(|(a, after)| (a.lock(), *after)).collect();
            let mut items: Vec<_> = ps
                .iter()
                .zip(guards.iter_mut())
                .map(|(p, (g, after))| (p.as_str(), &mut **g, *after))
                .collect();
            h.publish_many_then(&mut items)
        });
        for ((_, after), x) in held.iter().zip(&hs) {
            x.get().stored(py, *after)?;
        }
        r.map_err(os_error)?
            .into_iter()
            .map(publish_outcome)
            .collect()
    }

    /// Gives an unstored allocation back.
    fn free(&self, py: Python<'_>, handle: &Bound<'_, AllocHandle>) -> PyResult<()> {
        let h = self.handler()?;
        let a = Self::held(handle)?;
        py.detach(|| h.free_in_place(&mut a.lock()))
            .map_err(|e| match e {
                Error::InvalidArgument(m) => PyValueError::new_err(m),
                e => os_error(e),
            })
    }

    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (h, p) = (self.handler()?, self.path(key)?);
        ok_or_absent(py.detach(|| delete_key(&h, &p)))
    }

    fn batch_delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let (h, ps) = (self.handler()?, self.paths(keys)?);
        let refs: Vec<&str> = ps.iter().map(String::as_str).collect();
        // One request per namespace, then the segment namespaces of the long keys deleted.
        let out = py
            .detach(|| {
                let out = h.batch_delete(&refs)?;
                for (p, r) in ps.iter().zip(&out) {
                    if r.is_ok() {
                        remove_segments(&h, p);
                    }
                }
                Ok(out)
            })
            .map_err(os_error)?;
        out.into_iter().map(ok_or_absent).collect()
    }

    /// Takes (`hold`) or gives back one of this client's holds on each key.
    fn batch_hold(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        hold: bool,
    ) -> PyResult<Vec<bool>> {
        let (h, ps) = (self.handler()?, self.paths(keys)?);
        let refs: Vec<&str> = ps.iter().map(String::as_str).collect();
        let out = py.detach(|| h.batch_hold(&refs, hold)).map_err(os_error)?;
        out.into_iter().map(ok_or_absent).collect()
    }

    fn hold(&self, py: Python<'_>, key: &Bound<'_, PyAny>, hold: bool) -> PyResult<bool> {
        let (h, p) = (self.handler()?, self.path(key)?);
        ok_or_absent(py.detach(|| if hold { h.hold(&p) } else { h.unhold(&p) }))
    }

    /// The store's statistics, as JSON (marud's `Stats`).
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let h = self.handler()?;
        let s = py.detach(|| h.stats()).map_err(os_error)?;
        serde_json::to_string(&s).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The pools as of the handshake, as JSON.
    fn pools_json(&self) -> &str {
        &self.pools_json
    }

    /// True if marud answers.
    fn healthcheck(&self, py: Python<'_>) -> bool {
        self.handler()
            .is_ok_and(|h| py.detach(|| h.stats()).is_ok())
    }

    /// A read-only view of all of raw pool `pool` (`None` until this client holds its
    /// descriptor, and for memfs pools).
    fn pool_view(&self, py: Python<'_>, pool: u32) -> PyResult<Option<Py<PyAny>>> {
        let h = self.handler()?;
        match py.detach(|| h.map_pool(pool)).map_err(os_error)? {
            Some(m) => PoolBuffer::of_mapping(m).view(py).map(Some),
            None => Ok(None),
        }
    }

    /// The keys of the namespace (as bytes), long ones included.
    fn list_keys(&self, py: Python<'_>) -> PyResult<Vec<Py<PyBytes>>> {
        let h = self.handler()?;
        let names = py
            .detach(|| list_names(&h, &self.ns, ""))
            .map_err(os_error)?;
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

/// Deletes `path`, then the namespaces of a long key's segments that it left empty.
fn delete_key(h: &maru::Handler, path: &str) -> maru::Result<()> {
    h.delete(path)?;
    remove_segments(h, path);
    Ok(())
}

/// Removes the segment namespaces of deleted long key `path` that are left empty.
fn remove_segments(h: &maru::Handler, path: &str) {
    for ns in maru::key::segment_namespaces(path).into_iter().rev() {
        if h.rmdir(ns).is_err() {
            break;
        }
    }
}

/// Entry names under `ns`, relative to the handler's namespace (`prefix` + name), following
/// long keys' segment namespaces.
fn list_names(h: &maru::Handler, ns: &str, prefix: &str) -> maru::Result<Vec<String>> {
    let (_, children, entries) = h.list(ns)?;
    let mut out: Vec<String> = entries
        .into_iter()
        .map(|e| format!("{prefix}{}", e.key))
        .collect();
    for c in children {
        let Some(name) = c.ns.rsplit('/').next() else {
            continue;
        };
        if name.ends_with(maru::key::CONTINUED) {
            out.extend(list_names(h, &c.ns, &format!("{prefix}{name}/"))?);
        }
    }
    Ok(out)
}
