//! The library of maructl and marutop: the commands, the host check (`doctor`), the live view
//! and the benchmark harness.

pub mod bench;
pub mod ctl;
pub mod doctor;
pub mod env;
pub mod top;
