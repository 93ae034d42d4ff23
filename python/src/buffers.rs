//! Pool memory exported through the buffer protocol, kept alive by the exporter.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Copies `views`, one after the other, into `dst` (exactly as long as they are together):
/// the C-contiguous ones with the GIL released, so that a large `put` does not stop the
/// interpreter's other threads; any other through Python.
pub fn gather(py: Python<'_>, views: &[PyBuffer<u8>], dst: &mut [u8]) -> PyResult<()> {
    let mut plain = Vec::with_capacity(views.len());
    let mut at = 0;
    for v in views {
        let n = v.len_bytes();
        if v.is_c_contiguous() {
            plain.push((v.buf_ptr() as usize, at, n));
        } else {
            v.copy_to_slice(py, &mut dst[at..at + n])?;
        }
        at += n;
    }
    assert_eq!(at, dst.len(), "the views fill the destination");
    py.detach(|| {
        for (from, at, n) in plain {
            // SAFETY: `from` is the first of `n` bytes of a C-contiguous buffer that its
            // `PyBuffer` in `views` keeps valid while this runs (the exporter keeps the
            // memory, and a resizable one refuses to resize, while a buffer of it is held);
            // `at + n` is within `dst`. `copy` allows the two to overlap.
            unsafe { std::ptr::copy(from as *const u8, dst.as_mut_ptr().add(at), n) };
        }
    });
    Ok(())
}

/// What keeps an exported range mapped: a [`maru::Mapping`] (a sealed entry, or a raw pool,
/// read-only), an allocation (its mapping lives as long as the handle), or a lease of a remote
/// handler's staging buffer (its piece stays leased while the buffer lives).
type Keep = Box<dyn std::any::Any + Send + Sync>;

/// A range of pool memory; `memoryview(b)` (or `numpy.frombuffer`, `torch.frombuffer`) sees
/// it without a copy, and keeps it mapped while any view of it lives.
#[pyclass(module = "maru._native", frozen)]
pub struct PoolBuffer {
    addr: usize,
    len: usize,
    readonly: bool,
    /// Buffers handed out and not yet released (a `memoryview` of this holds one while it,
    /// or any view sliced from it, lives).
    exports: AtomicUsize,
    _keep: Keep,
}

impl PoolBuffer {
    /// A read-only buffer over `m`'s bytes.
    pub fn of_mapping(m: maru::Mapping) -> Self {
        PoolBuffer {
            addr: m.as_ptr() as usize,
            len: m.len(),
            readonly: true,
            exports: AtomicUsize::new(0),
            _keep: Box::new(m),
        }
    }

    /// A writable buffer over an allocation's bytes.
    pub fn of_alloc(h: &Arc<Mutex<maru::AllocHandle>>) -> Self {
        let mut g = h.lock();
        PoolBuffer {
            addr: g.as_mut_ptr() as usize,
            len: g.len(),
            readonly: false,
            exports: AtomicUsize::new(0),
            _keep: Box::new(h.clone()),
        }
    }

    /// A buffer over a lease of a remote handler's staging buffer (writable: an allocation;
    /// read-only: a retrieved entry's bytes).
    pub fn of_lease(lease: Arc<maru_remote::Lease>, readonly: bool) -> Self {
        PoolBuffer {
            addr: lease.as_mut_ptr() as usize,
            len: lease.len(),
            readonly,
            exports: AtomicUsize::new(0),
            _keep: Box::new(lease),
        }
    }

    /// A `memoryview` of this buffer.
    pub fn view(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Self::view_of(&Bound::new(py, self)?)
    }

    /// A `memoryview` of `me`.
    pub fn view_of(me: &Bound<'_, PoolBuffer>) -> PyResult<Py<PyAny>> {
        // SAFETY: `me` is a live object implementing the buffer protocol; the call returns a
        // new reference or NULL with an exception set.
        unsafe {
            Bound::from_owned_ptr_or_err(me.py(), ffi::PyMemoryView_FromObject(me.as_ptr()))
                .map(Bound::unbind)
        }
    }

    /// Whether some buffer of these bytes is still held (by a view, a slice of one, or an
    /// object built on one).
    pub fn exported(&self) -> bool {
        self.exports.load(Ordering::Acquire) > 0
    }
}

#[pymethods]
impl PoolBuffer {
    fn __len__(&self) -> usize {
        self.len
    }

    /// # Safety
    ///
    /// Called by Python with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        if view.is_null() {
            return Err(PyBufferError::new_err("no Py_buffer to fill"));
        }
        if flags & ffi::PyBUF_WRITABLE != 0 && me.readonly {
            return Err(PyBufferError::new_err(
                "a sealed maru entry is read-only (copy it to change it)",
            ));
        }
        // SAFETY: `view` is valid (checked above); the range stays mapped while the exporter,
        // which PyBuffer_FillInfo references from the view, lives.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.addr as *mut c_void,
                me.len as ffi::Py_ssize_t,
                c_int::from(me.readonly),
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// # Safety
    ///
    /// Called by Python with a buffer this object filled.
    unsafe fn __releasebuffer__(slf: Bound<'_, Self>, _view: *mut ffi::Py_buffer) {
        slf.get().exports.fetch_sub(1, Ordering::AcqRel);
    }
}
