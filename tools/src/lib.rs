//! maructl's library: the commands and the benchmark harness.

pub mod bench;
pub mod ctl;
pub mod env;
pub mod top;
