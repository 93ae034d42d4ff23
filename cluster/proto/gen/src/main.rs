//! Compiles `cluster/proto/*.proto` with protox (a protobuf compiler written in Rust) and
//! writes the Rust code of the messages and of the gRPC clients into the directory given.
//! `regen.sh` runs it and formats the result; the generated files are kept in the tree so that
//! building maru needs neither protoc nor this program.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let (Some(proto_dir), Some(out_dir)) = (args.next(), args.next()) else {
        return Err("usage: maru-etcd-gen PROTO_DIR OUT_DIR".into());
    };
    let proto_dir = PathBuf::from(proto_dir);
    let fds = protox::compile([proto_dir.join("etcdserverpb.proto")], [&proto_dir])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .out_dir(out_dir)
        .compile_fds(fds)?;
    Ok(())
}
