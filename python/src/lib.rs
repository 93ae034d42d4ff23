//! `maru._native`: the core of maru's Python package, over libmaru.
//!
//! [`Core`] is one connection to marud (a libmaru [`maru::Handler`]) bound to one namespace.
//! Keys are `str`, `bytes` or `int`, mapped to entry names by [`maru::key`]. Buffers are
//! exported through the buffer protocol straight from the pool's mappings: a retrieved
//! entry's `view` is the pool's own pages (read-only), an allocation's `buf` the pool pages
//! it will publish (writable until stored or freed, then this process's private copy).
//! Every call that may wait for marud releases the GIL. [`remote::RemoteCore`] is the same
//! verbs over a memory node's pool (`maru_remote`), its buffers pieces of a registered staging
//! buffer.

mod buffers;
mod core;
mod remote;

use pyo3::prelude::*;

/// The entry name of a key (relative to its namespace; `seg%+/…/last` for long keys).
#[pyfunction]
fn encode_key(key: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(maru::key::encode(&core::key_bytes(key)?))
}

/// Loads NIXL (as the remote backend does: `MARU_NIXL_LIB`, `$NIXL_PREFIX`, the nixl-cu12
/// wheel...) and returns the library's path; `OSError` with the places searched where it is
/// not installed. UCX reads its environment when NIXL loads: set `UCX_*` first.
#[pyfunction]
fn nixl_library(py: Python<'_>) -> PyResult<String> {
    py.detach(maru_nixl::Nixl::load)
        .map(|n| n.path().to_string_lossy().into_owned())
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))
}

/// The key an entry name stands for (as bytes).
#[pyfunction]
fn decode_key(name: &str) -> PyResult<Vec<u8>> {
    maru::key::decode(name).map_err(core::os_error)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<core::Core>()?;
    m.add_class::<core::AllocHandle>()?;
    m.add_class::<core::MemoryInfo>()?;
    m.add_class::<buffers::PoolBuffer>()?;
    m.add_class::<remote::RemoteCore>()?;
    m.add_function(wrap_pyfunction!(encode_key, m)?)?;
    m.add_function(wrap_pyfunction!(decode_key, m)?)?;
    m.add_function(wrap_pyfunction!(nixl_library, m)?)?;
    m.add("DEFAULT_SOCKET", maru::DEFAULT_SOCKET)?;
    m.add("MEMFS_REGION_BASE", core::MEMFS_REGION_BASE)?;
    m.add("RAW_PAGE_SIZE", core::RAW_PAGE_SIZE)?;
    m.add("STAGING_REGION", remote::STAGING_REGION)?;
    m.add("STAGING_PAGE_SIZE", maru_remote::ARENA_ALIGN)?;
    Ok(())
}
