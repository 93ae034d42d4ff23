//! The library of maructl and marutop: the commands, the host check (`doctor`), the live view,
//! the remote commands (`maructl --remote`) and the benchmark harness.

pub mod bench;
pub mod ctl;
pub mod doctor;
pub mod env;
pub mod remote;
pub mod top;
