//! Clients' pins on other hosts' entries (the original API's pin counts): recorded in etcd
//! under this host's lease, so that their publisher does not evict them meanwhile, in the
//! order the store took and gave them back, one after the other on a task of their own.

use std::collections::HashSet;
use std::sync::Arc;

use maru_cluster::Member;
use parking_lot::Mutex;
use tokio::sync::{RwLock, mpsc, oneshot};

/// The seam before a client pin's record goes to etcd (tests; feature `seams`).
#[cfg(feature = "seams")]
pub type PinGate = super::seams::Gate;

type Name = (String, String);

/// A record's outcome, for whoever waits for it.
pub(super) type Outcome = oneshot::Receiver<maru_cluster::Result<()>>;

/// Client pins to record (with whoever waits for the outcome) or take back.
struct Update {
    names: Vec<Name>,
    pinned: bool,
    done: Option<oneshot::Sender<maru_cluster::Result<()>>>,
}

/// The pins clients of this host take on other hosts' entries.
pub(super) struct ClientPins {
    /// The entries pinned here: those recorded in etcd and those whose record is on its way.
    here: Mutex<HashSet<Name>>,
    /// To the recorder, in order.
    tx: mpsc::UnboundedSender<Update>,
    #[cfg(feature = "seams")]
    gate: Arc<parking_lot::RwLock<Option<PinGate>>>,
}

impl ClientPins {
    /// Starts the recorder on `rt`, recording through `member`.
    pub(super) fn start(rt: &tokio::runtime::Handle, member: Arc<RwLock<Member>>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let pins = ClientPins {
            here: Mutex::new(HashSet::new()),
            tx,
            #[cfg(feature = "seams")]
            gate: Arc::default(),
        };
        #[cfg(feature = "seams")]
        let gate = pins.gate.clone();
        rt.spawn(async move {
            #[cfg(feature = "seams")]
            let pass = || super::seams::through(&gate);
            #[cfg(not(feature = "seams"))]
            let pass = || std::future::ready(());
            record(member, rx, pass).await
        });
        pins
    }

    /// Asks for the first pins here of `names` to be recorded; their outcome, or None when
    /// the recorder stopped (the runtime is going).
    pub(super) fn pin(&self, names: &[Name]) -> Option<Outcome> {
        let (done, outcome) = oneshot::channel();
        self.tx
            .send(Update {
                names: names.to_vec(),
                pinned: true,
                done: Some(done),
            })
            .ok()?;
        // Counted from now on, so that an unpin asked before the outcome takes it out (and
        // the store gives it back itself should the record fail).
        self.here.lock().extend(names.iter().cloned());
        Some(outcome)
    }

    /// The last pins here of `names` went: taken back, in the background.
    pub(super) fn unpin(&self, names: &[Name]) {
        {
            let mut here = self.here.lock();
            for n in names {
                here.remove(n);
            }
        }
        let _ = self.tx.send(Update {
            names: names.to_vec(),
            pinned: false,
            done: None,
        });
    }

    /// The entries pinned here (to record again under a new lease).
    pub(super) fn here(&self) -> Vec<Name> {
        self.here.lock().iter().cloned().collect()
    }

    /// Installs the seam before a pin's record goes to etcd (tests).
    #[cfg(feature = "seams")]
    pub(super) fn set_gate(&self, gate: Option<PinGate>) {
        *self.gate.write() = gate;
    }
}

/// Records client pins in etcd in the order they were taken and given back, so that a pin
/// taken right after an unpin of the same entry is never undone by it.
async fn record<P: Future<Output = ()>>(
    m: Arc<RwLock<Member>>,
    mut rx: mpsc::UnboundedReceiver<Update>,
    pass: impl Fn() -> P,
) {
    while let Some(u) = rx.recv().await {
        if u.pinned {
            pass().await;
        }
        let r = m.read().await.pin_for_clients(&u.names, u.pinned).await;
        match u.done {
            Some(done) => {
                let _ = done.send(r);
            }
            None => {
                if let Err(e) = r {
                    tracing::warn!("taking back pins of clients here: {e}");
                }
            }
        }
    }
}
