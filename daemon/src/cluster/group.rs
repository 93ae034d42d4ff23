//! Group commit of publications and removals: those waiting at the same moment (a client's
//! batch, other clients', the mount's) go to etcd together, in as few transactions as etcd's
//! operation limit allows (`maru_cluster::Member::publish_many`, `remove_many`), each with
//! its own outcome. One commit is in flight at a time; while it is, what arrives waits and
//! goes with the next one, so the busier the host, the larger its transactions.

use std::sync::Arc;

use maru_cluster::{EntryAt, EntryRecord, Member, Publication, Published, Removed, Removing};
use tokio::sync::{RwLock, Semaphore, mpsc};

/// Transactions in flight at once.
const IN_FLIGHT: usize = 1;

/// Publications one commit takes at most (its transactions go to etcd together).
const PER_COMMIT: usize = 256;

/// One publication waiting for its commit.
pub(super) struct Item {
    pub ns: String,
    pub key: String,
    pub record: EntryRecord,
    /// This host reserved the name for a writer through its mount.
    pub reserved: bool,
}

/// One removal waiting for its commit.
pub(super) struct Withdrawal {
    pub ns: String,
    pub key: String,
    /// The entry meant, if this host knows it (None: whichever is there).
    pub entry: Option<EntryAt>,
}

/// What a caller waits for: publications or removals, and where their outcomes go.
enum Job {
    Publish(
        Vec<Item>,
        std::sync::mpsc::SyncSender<Vec<maru_cluster::Result<Published>>>,
    ),
    Remove(
        Vec<Withdrawal>,
        std::sync::mpsc::SyncSender<Vec<maru_cluster::Result<Removed>>>,
    ),
}

impl Job {
    fn len(&self) -> usize {
        match self {
            Job::Publish(items, _) => items.len(),
            Job::Remove(names, _) => names.len(),
        }
    }
}

/// The seam before a commit's removals go to etcd (tests; feature `seams`): when one is set,
/// each commit with removals takes one of its permits first, its publications going on.
#[cfg(feature = "seams")]
pub type RemovalGate = super::seams::Gate;

/// Where the committer finds the seam [`RemovalGate`] (nothing without feature `seams`).
#[derive(Clone, Default)]
pub(super) struct Seam {
    #[cfg(feature = "seams")]
    removals: Arc<parking_lot::RwLock<Option<RemovalGate>>>,
}

impl Seam {
    /// Installs the seam before a commit's removals (tests).
    #[cfg(feature = "seams")]
    pub(super) fn set_removal_gate(&self, gate: Option<RemovalGate>) {
        *self.removals.write() = gate;
    }

    /// Waits for a permit of the removals' seam, if one is set.
    async fn before_removals(&self) {
        #[cfg(feature = "seams")]
        super::seams::through(&self.removals).await;
    }
}

/// The queue of publications and removals waiting for etcd, and its committer.
pub(super) struct GroupCommit {
    tx: mpsc::UnboundedSender<Job>,
    #[cfg(feature = "seams")]
    seam: Seam,
}

impl GroupCommit {
    /// Starts the committer on `rt`.
    pub(super) fn start(rt: &tokio::runtime::Runtime, member: Arc<RwLock<Member>>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let seam = Seam::default();
        rt.spawn(commit(member, rx, seam.clone()));
        GroupCommit {
            tx,
            #[cfg(feature = "seams")]
            seam,
        }
    }

    /// Installs the seam before a commit's removals go to etcd (tests).
    #[cfg(feature = "seams")]
    pub(super) fn set_removal_gate(&self, gate: Option<RemovalGate>) {
        self.seam.set_removal_gate(gate);
    }

    /// Publishes `items` with the publications waiting beside them, and waits for their
    /// outcomes (one each, in order). Called from a thread that is not the cluster
    /// runtime's.
    pub(super) fn publish(&self, items: Vec<Item>) -> Vec<maru_cluster::Result<Published>> {
        let n = items.len();
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.wait(Job::Publish(items, reply), rx, n)
    }

    /// Removes entries `names` with the removals waiting beside them, as
    /// [`GroupCommit::publish`] publishes.
    pub(super) fn remove(&self, names: Vec<Withdrawal>) -> Vec<maru_cluster::Result<Removed>> {
        let n = names.len();
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        self.wait(Job::Remove(names, reply), rx, n)
    }

    fn wait<T>(
        &self,
        job: Job,
        rx: std::sync::mpsc::Receiver<Vec<maru_cluster::Result<T>>>,
        n: usize,
    ) -> Vec<maru_cluster::Result<T>> {
        crate::store::assert_unlocked("a wait for etcd's commit");
        if self.tx.send(job).is_ok()
            && let Ok(out) = rx.recv()
        {
            return out;
        }
        (0..n).map(|_| Err(stopped())).collect()
    }
}

fn stopped() -> maru_cluster::Error {
    maru_cluster::Error::Etcd(maru_cluster::etcd::Error::StreamEnded)
}

/// The committer: takes what waits (up to [`PER_COMMIT`] items) once a commit may start, and
/// sends it on its way: its publications and its removals, each kind in as few transactions
/// as it takes, both at once.
async fn commit(member: Arc<RwLock<Member>>, mut rx: mpsc::UnboundedReceiver<Job>, seam: Seam) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut n = first.len();
        let mut jobs = vec![first];
        while n < PER_COMMIT {
            match rx.try_recv() {
                Ok(j) => {
                    n += j.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        let (m, seam) = (member.clone(), seam.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let (mut publishing, mut removing) = (Vec::new(), Vec::new());
            let (mut to_publishers, mut to_removers) = (Vec::new(), Vec::new());
            for j in &jobs {
                match j {
                    Job::Publish(items, reply) => {
                        publishing.extend(items.iter().map(|i| Publication {
                            ns: &i.ns,
                            name: &i.key,
                            record: &i.record,
                            reserved: i.reserved,
                        }));
                        to_publishers.push((items.len(), reply.clone()));
                    }
                    Job::Remove(names, reply) => {
                        removing.extend(names.iter().map(|w| Removing {
                            ns: &w.ns,
                            name: &w.key,
                            entry: w.entry,
                        }));
                        to_removers.push((names.len(), reply.clone()));
                    }
                }
            }
            let m = m.read().await;
            // Each kind answered as soon as its own transactions are: a publication etcd took
            // is not held back by a removal beside it that waits out its timeout (seed 1657:
            // acknowledged 2 s late, past the host's fence, though etcd had taken it before
            // the host was cut off).
            tokio::join!(
                async {
                    // Each caller answered once its own items have their outcomes (seed
                    // 2001: a publication etcd took waited 2 s for another transaction of the
                    // batch, sent to a member just cut off).
                    let mut answers = Answers::new(to_publishers);
                    m.publish_each(&publishing, |i, r| answers.done(i, r)).await;
                },
                async {
                    if !removing.is_empty() {
                        seam.before_removals().await;
                    }
                    let mut out = m.remove_many(&removing).await.into_iter();
                    for (n, reply) in to_removers {
                        let _ = reply.send(out.by_ref().take(n).collect());
                    }
                }
            );
        });
    }
}

/// The outcomes of a commit's publications, gathered per caller (in the order the callers'
/// items were taken): each caller's reply goes as soon as all of its items have theirs.
struct Answers<T> {
    /// Per caller: its outcomes so far, how many are missing, where to send them.
    callers: Vec<(Outcomes<T>, usize, Reply<T>)>,
    /// Per item of the commit: its caller and its place among the caller's items.
    owner: Vec<(usize, usize)>,
}

type Reply<T> = std::sync::mpsc::SyncSender<Vec<maru_cluster::Result<T>>>;

/// A caller's outcomes, each once known.
type Outcomes<T> = Vec<Option<maru_cluster::Result<T>>>;

impl<T> Answers<T> {
    fn new(callers: Vec<(usize, Reply<T>)>) -> Self {
        let owner = callers
            .iter()
            .enumerate()
            .flat_map(|(c, (n, _))| (0..*n).map(move |k| (c, k)))
            .collect();
        let callers = callers
            .into_iter()
            .map(|(n, reply)| {
                if n == 0 {
                    let _ = reply.send(Vec::new());
                }
                ((0..n).map(|_| None).collect(), n, reply)
            })
            .collect();
        Answers { callers, owner }
    }

    /// Item `i` of the commit has outcome `r`.
    fn done(&mut self, i: usize, r: maru_cluster::Result<T>) {
        let (c, k) = self.owner[i];
        let (got, missing, reply) = &mut self.callers[c];
        if got[k].replace(r).is_some() {
            return; // told twice (never): answered already, or to be
        }
        *missing -= 1;
        if *missing == 0 {
            let all = got
                .iter_mut()
                .map(|o| o.take().expect("every item has its outcome"))
                .collect();
            let _ = reply.send(all);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller is answered as soon as its own items have their outcomes, whatever the
    /// others' wait for; each in its items' order.
    #[test]
    fn each_caller_is_answered_once_its_own_items_are() {
        let (tx0, rx0) = std::sync::mpsc::sync_channel(1);
        let (tx1, rx1) = std::sync::mpsc::sync_channel(1);
        let (tx2, rx2) = std::sync::mpsc::sync_channel(1);
        let mut a = Answers::<u32>::new(vec![(2, tx0), (1, tx1), (0, tx2)]);
        assert_eq!(
            rx2.try_recv().map(|v| v.len()),
            Ok(0),
            "nothing to wait for"
        );
        a.done(2, Ok(20));
        let one: Vec<u32> = rx1.try_recv().unwrap().into_iter().flatten().collect();
        assert_eq!(one, [20]);
        a.done(1, Ok(10));
        assert!(rx0.try_recv().is_err(), "answered before its first item");
        a.done(0, Err(stopped()));
        let zero = rx0.try_recv().unwrap();
        assert!(zero[0].is_err());
        assert_eq!(zero[1].as_ref().ok(), Some(&10));
    }
}
