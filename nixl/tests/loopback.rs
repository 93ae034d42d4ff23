//! Two NIXL agents in one process move bytes over UCX's TCP transport on loopback: WRITE and
//! READ of 32 MiB, a list of 64 pieces of 4 KiB, a transfer that times out, and the errors of a transfer to a peer whose
//! metadata was never loaded or was forgotten. Real NIXL: the test skips where NIXL is not
//! installed, except where `MARU_REQUIRE_NIXL` is set (CI), where it fails.
//!
//! One test function: UCX reads its environment once, so it is set before anything starts.

use std::time::Duration;

use maru_nixl::{AgentConfig, Desc, Mem, Nixl, Op};

fn nixl() -> Option<Nixl> {
    // SAFETY: the only test of this binary, before any thread of NIXL's or UCX's exists.
    unsafe {
        std::env::set_var("UCX_TLS", "tcp");
        std::env::set_var("UCX_NET_DEVICES", "lo");
        // Where rdma-core is installed, UCX's ib module crashes NIXL processes at exit.
        std::env::set_var("UCX_MODULES", "^ib");
    }
    match Nixl::load() {
        Ok(n) => Some(n),
        Err(e) if std::env::var_os("MARU_REQUIRE_NIXL").is_none() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("MARU_REQUIRE_NIXL is set and NIXL does not load: {e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn whole(buf: &[u8]) -> Desc {
    Desc::host(buf.as_ptr() as u64, buf.len() as u64)
}

#[test]
fn two_agents_write_and_read_over_ucx_tcp() {
    let Some(nixl) = nixl() else { return };
    let config = AgentConfig::default();
    let mut target = nixl.agent("target", &config).expect("target agent");
    let mut initiator = nixl.agent("initiator", &config).expect("initiator agent");
    target.add_backend("UCX", &[]).expect("target UCX backend");
    initiator
        .add_backend("UCX", &[])
        .expect("initiator UCX backend");

    const LEN: usize = 32 << 20;
    let mut remote = vec![0u8; LEN];
    let mut local = pattern(LEN, 7);
    target
        .register(Mem::Dram, &[whole(&remote)])
        .expect("register target");
    initiator
        .register(Mem::Dram, &[whole(&local)])
        .expect("register initiator");
    let peer = initiator
        .load_peer(&target.metadata().expect("metadata"))
        .expect("load target's metadata");
    assert_eq!(peer, "target");

    // WRITE: the initiator's bytes land in the target's memory, which never calls NIXL.
    let mut w = initiator
        .transfer(
            Op::Write,
            Mem::Dram,
            &[whole(&local)],
            Mem::Dram,
            &[whole(&remote)],
            &peer,
        )
        .expect("post write");
    w.wait(Duration::from_secs(60)).expect("write");
    drop(w);
    assert!(remote == local, "the written bytes differ");

    // READ: the target's (changed) bytes come back.
    remote.copy_from_slice(&pattern(LEN, 99));
    let mut r = initiator
        .transfer(
            Op::Read,
            Mem::Dram,
            &[whole(&local)],
            Mem::Dram,
            &[whole(&remote)],
            &peer,
        )
        .expect("post read");
    r.wait(Duration::from_secs(60)).expect("read");
    drop(r);
    assert!(local == remote, "the read bytes differ");

    // A list of 64 pieces of 4 KiB, scattered on both sides, in one request.
    local.copy_from_slice(&pattern(LEN, 3));
    let (l, rm): (Vec<Desc>, Vec<Desc>) = (0..64u64)
        .map(|i| {
            (
                Desc::host(local.as_ptr() as u64 + i * 8192, 4096),
                Desc::host(remote.as_ptr() as u64 + (63 - i) * 65536, 4096),
            )
        })
        .unzip();
    let mut w = initiator
        .transfer(Op::Write, Mem::Dram, &l, Mem::Dram, &rm, &peer)
        .expect("post list");
    w.wait(Duration::from_secs(60)).expect("list write");
    drop(w);
    for i in 0..64usize {
        let (lo, ro) = (i * 8192, (63 - i) * 65536);
        assert!(
            local[lo..lo + 4096] == remote[ro..ro + 4096],
            "piece {i} differs"
        );
    }

    // A zero timeout times out every transfer, even one that ended before it was waited for
    // (the deadline counts from the posting and is strict: a transport may finish a transfer
    // inside the post or by the first poll); each still ends.
    for i in 0..16 {
        let mut w = initiator
            .transfer(Op::Write, Mem::Dram, &l[..1], Mem::Dram, &rm[..1], &peer)
            .expect("post one piece");
        if i % 2 == 1 {
            // Time for UCX to finish it, so the first poll finds it done.
            std::thread::sleep(Duration::from_millis(5));
        }
        let hasty = w.wait(Duration::ZERO);
        assert!(
            matches!(hasty, Err(maru_nixl::Error::TimedOut(_))),
            "transfer {i}: {hasty:?}"
        );
        w.wait(Duration::from_secs(60)).expect("the piece ends");
        assert!(w.is_done());
    }

    // Lists of different shapes, a peer never loaded, a peer forgotten: clear errors.
    assert!(
        initiator
            .transfer(Op::Read, Mem::Dram, &l[..2], Mem::Dram, &rm[..1], &peer)
            .is_err()
    );
    assert!(
        initiator
            .transfer(Op::Read, Mem::Dram, &l, Mem::Dram, &rm, "nobody")
            .is_err()
    );
    initiator.forget_peer(&peer).expect("forget");
    let gone = initiator.transfer(Op::Read, Mem::Dram, &l, Mem::Dram, &rm, &peer);
    assert!(gone.is_err(), "a transfer to a forgotten peer was posted");
    drop(gone);

    initiator
        .deregister(Mem::Dram, &[whole(&local)])
        .expect("deregister");
    target
        .deregister(Mem::Dram, &[whole(&remote)])
        .expect("deregister");
}
