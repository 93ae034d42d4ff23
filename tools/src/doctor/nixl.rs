//! NIXL, which the remote tier loads: found by the remote tier's own search
//! ([`maru_nixl::Nixl::locate`]: `MARU_NIXL_LIB`, `NIXL_PREFIX`, NIXL's default prefix, the
//! `nixl` wheels of `python3`, then the dynamic loader's paths). Optional: its absence is a
//! `skip`, unless the config opens the remote door (`remote_bind`), which needs it.

use std::time::Duration;

use maru_nixl::{Error, Nixl};

use super::target::{Check, Status, Target, bounded};

/// The search asks `python3` for its paths (within 5 s) and may load the library.
const SEARCH_LIMIT: Duration = Duration::from_secs(8);

/// NIXL for the remote tier: optional, unless `t` opens the remote door.
pub(super) fn nixl(t: &Target) -> Check {
    const NAME: &str = "nixl";
    const INSTALL: &str = "pip install nixl (or set MARU_NIXL_LIB to libnixl_capi.so's path)";
    match bounded(SEARCH_LIMIT, Nixl::locate) {
        Some(Ok(Some(path))) => Check::ok(
            NAME,
            format!("{} (found where the remote tier looks)", path.display()),
        ),
        Some(Ok(None)) => Check::ok(
            NAME,
            "libnixl_capi.so is on the dynamic loader's paths (found where the remote tier looks)",
        ),
        // Its message lists every path searched: too long for one line of the report.
        Some(Err(Error::NotFound { .. })) if t.file.remote_bind.is_some() => Check::fail(
            NAME,
            "no libnixl_capi.so where the remote tier looks, and remote_bind opens the remote \
             door: marud needs NIXL for it",
            INSTALL,
        ),
        Some(Err(Error::NotFound { .. })) => Check::new(
            NAME,
            Status::Skip,
            "no libnixl_capi.so where the remote tier looks (MARU_NIXL_LIB, NIXL_PREFIX, \
             /opt/nvidia/nvda_nixl, python3's nixl wheels, the loader's paths): no remote tier \
             (it is optional)",
            Some(INSTALL.into()),
        ),
        Some(Err(e)) => Check::warn(NAME, format!("{e}"), INSTALL),
        None => Check::warn(
            NAME,
            format!("the search for NIXL took over {}s", SEARCH_LIMIT.as_secs()),
            "set MARU_NIXL_LIB to libnixl_capi.so's path",
        ),
    }
}
