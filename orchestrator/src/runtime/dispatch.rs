//! The slot and lease state machine: which batch sits in which shared-memory slot, which worker
//! holds which batch, and the plan-order cursors (fed, trained, committed). A plain struct with no
//! I/O, so property tests drive it through random feed/lease/crash/rewind sequences; the run loop
//! calls it and does the writing, publishing and sending.
//!
//! The guarantees: a batch is handed to at most one worker at a time, the drafter gets batches
//! strictly in plan order, batches are committed exactly once and in plan order (a rewind voids
//! the commits after its position, and they are made again), and a worker's death gives its slots
//! back (`reclaim`).

use std::collections::{BTreeSet, VecDeque};

use dflash_common::wire::SlotRef;

/// An input slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InSlot {
    Free,
    /// Holds a batch not yet handed to a target.
    Filled(usize),
    Leased(usize),
}

/// A feature slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatSlot {
    Free,
    Forwarding(usize),
    Ready(usize),
    Training(usize),
    Trained(usize),
}

/// What a worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    Forward {
        batch: usize,
        input: u32,
        feature: u32,
    },
    Train {
        batch: usize,
        feature: u32,
    },
}

impl Lease {
    pub fn batch(self) -> usize {
        match self {
            Lease::Forward { batch, .. } | Lease::Train { batch, .. } => batch,
        }
    }
}

/// A forward job to send: the batch, where its tokens are, where its features go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardJob {
    pub batch: usize,
    pub input: SlotRef,
    pub feature: SlotRef,
}

/// A training job to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainJob {
    pub batch: usize,
    pub feature: SlotRef,
}

/// A worker reported a result for work it does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a result for work the worker was not given")]
pub struct NotLeased;

/// The state of every slot and lease of one epoch's pipeline.
#[derive(Debug, Clone)]
pub struct Dispatch {
    batches: usize,
    next_feed: usize,
    /// Fed batches waiting for a target, in plan order.
    queue: VecDeque<usize>,
    /// The input slot of each fed batch of the epoch.
    batch_input: Vec<u32>,
    /// Forwarded batches waiting for the drafter.
    to_train: BTreeSet<usize>,
    /// The next batch the drafter gets (plan order).
    next_train: usize,
    next_commit: usize,
    input_slots: Vec<InSlot>,
    input_generation: Vec<u64>,
    feature_slots: Vec<FeatSlot>,
    feature_generation: Vec<u64>,
    leases: Vec<Option<Lease>>,
}

impl Dispatch {
    pub fn new(input_slots: usize, feature_slots: usize, workers: usize) -> Self {
        Self {
            batches: 0,
            next_feed: 0,
            queue: VecDeque::new(),
            batch_input: Vec::new(),
            to_train: BTreeSet::new(),
            next_train: 0,
            next_commit: 0,
            input_slots: vec![InSlot::Free; input_slots],
            input_generation: vec![0; input_slots],
            feature_slots: vec![FeatSlot::Free; feature_slots],
            feature_generation: vec![0; feature_slots],
            leases: vec![None; workers],
        }
    }

    /// An empty pipeline positioned at `batch` of an epoch of `batches` batches: nothing fed,
    /// queued or leased. Call only when no worker holds a lease.
    pub fn enter(&mut self, batches: usize, batch: usize) {
        debug_assert!(!self.holds_leases(), "entering with leases outstanding");
        self.batches = batches;
        self.batch_input = vec![u32::MAX; batches];
        self.next_feed = batch;
        self.next_train = batch;
        self.next_commit = batch;
        self.queue.clear();
        self.to_train.clear();
        self.input_slots.fill(InSlot::Free);
        self.feature_slots.fill(FeatSlot::Free);
    }

    /// The next batch to feed and the free input slot it goes to, now marked filled; its
    /// generation is bumped (the caller writes the batch, then publishes with `generation`).
    pub fn feed(&mut self) -> Option<(usize, u32, u64)> {
        if self.next_feed >= self.batches {
            return None;
        }
        let slot = self.input_slots.iter().position(|s| *s == InSlot::Free)?;
        let b = self.next_feed;
        self.input_slots[slot] = InSlot::Filled(b);
        self.batch_input[b] = slot as u32;
        self.queue.push_back(b);
        self.next_feed += 1;
        self.input_generation[slot] += 1;
        Some((b, slot as u32, self.input_generation[slot]))
    }

    /// Leases the front of the queue to target `worker`, with a free feature slot for its output.
    pub fn lease_forward(&mut self, worker: usize) -> Option<ForwardJob> {
        if self.leases[worker].is_some() {
            return None;
        }
        let &batch = self.queue.front()?;
        let feature = self
            .feature_slots
            .iter()
            .position(|s| *s == FeatSlot::Free)?;
        self.queue.pop_front();
        let input = self.batch_input[batch];
        self.input_slots[input as usize] = InSlot::Leased(batch);
        self.feature_slots[feature] = FeatSlot::Forwarding(batch);
        self.feature_generation[feature] += 1;
        self.leases[worker] = Some(Lease::Forward {
            batch,
            input,
            feature: feature as u32,
        });
        Some(ForwardJob {
            batch,
            input: SlotRef {
                slot: input,
                generation: self.input_generation[input as usize],
            },
            feature: SlotRef {
                slot: feature as u32,
                generation: self.feature_generation[feature],
            },
        })
    }

    /// Target `worker` finished its forward: the input slot is free, the features are ready.
    pub fn forwarded(&mut self, worker: usize) -> Result<usize, NotLeased> {
        let Some(Lease::Forward {
            batch,
            input,
            feature,
        }) = self.leases[worker]
        else {
            return Err(NotLeased);
        };
        self.leases[worker] = None;
        self.input_slots[input as usize] = InSlot::Free;
        self.feature_slots[feature as usize] = FeatSlot::Ready(batch);
        self.to_train.insert(batch);
        Ok(batch)
    }

    /// Leases the next batch in plan order to drafter `worker`, if its features are ready.
    pub fn lease_train(&mut self, worker: usize) -> Option<TrainJob> {
        if self.leases[worker].is_some() {
            return None;
        }
        let &batch = self.to_train.first()?;
        if batch != self.next_train {
            return None; // strictly in plan order
        }
        let feature = self
            .feature_slots
            .iter()
            .position(|s| *s == FeatSlot::Ready(batch))?;
        self.next_train += 1;
        self.to_train.remove(&batch);
        self.feature_slots[feature] = FeatSlot::Training(batch);
        self.leases[worker] = Some(Lease::Train {
            batch,
            feature: feature as u32,
        });
        Some(TrainJob {
            batch,
            feature: SlotRef {
                slot: feature as u32,
                generation: self.feature_generation[feature],
            },
        })
    }

    /// Drafter `worker` trained its batch: the batch waits to be committed.
    pub fn trained(&mut self, worker: usize) -> Result<usize, NotLeased> {
        let Some(Lease::Train { batch, feature }) = self.leases[worker] else {
            return Err(NotLeased);
        };
        self.leases[worker] = None;
        self.feature_slots[feature as usize] = FeatSlot::Trained(batch);
        Ok(batch)
    }

    /// The next batch in plan order, if it is trained: its slot is freed and the commit cursor
    /// moves past it. The caller journals the commit.
    pub fn commit_next(&mut self) -> Option<usize> {
        let b = self.next_commit;
        let slot = self
            .feature_slots
            .iter()
            .position(|s| *s == FeatSlot::Trained(b))?;
        self.feature_slots[slot] = FeatSlot::Free;
        self.next_commit += 1;
        Some(b)
    }

    /// Commits the next batch without training it (the drafter's checkpoint already holds it).
    /// Call on an empty pipeline only.
    pub fn skip_next(&mut self) -> usize {
        let b = self.next_commit;
        self.next_commit += 1;
        self.next_feed = self.next_feed.max(self.next_commit);
        self.next_train = self.next_train.max(self.next_commit);
        b
    }

    /// Puts `worker`'s leased work back for others; returns the lease it held.
    pub fn reclaim(&mut self, worker: usize) -> Option<Lease> {
        let lease = self.leases[worker].take()?;
        match lease {
            Lease::Forward {
                batch,
                input,
                feature,
            } => {
                self.input_slots[input as usize] = InSlot::Filled(batch);
                self.feature_slots[feature as usize] = FeatSlot::Free;
                // Back to the front: plan order is kept.
                let at = self.queue.partition_point(|&q| q < batch);
                self.queue.insert(at, batch);
            }
            Lease::Train { batch, feature } => {
                self.feature_slots[feature as usize] = FeatSlot::Ready(batch);
                self.to_train.insert(batch);
                self.next_train = self.next_train.min(batch);
            }
        }
        Some(lease)
    }

    pub fn lease(&self, worker: usize) -> Option<Lease> {
        self.leases[worker]
    }

    pub fn holds_leases(&self) -> bool {
        self.leases.iter().any(Option::is_some)
    }

    pub fn next_commit(&self) -> usize {
        self.next_commit
    }

    /// Fractions of the input and feature slots in use.
    pub fn occupancy(&self) -> (f64, f64) {
        let used_in = self.input_slots.iter().filter(|s| **s != InSlot::Free);
        let used_feat = self.feature_slots.iter().filter(|s| **s != FeatSlot::Free);
        (
            used_in.count() as f64 / self.input_slots.len().max(1) as f64,
            used_feat.count() as f64 / self.feature_slots.len().max(1) as f64,
        )
    }

    /// Slots in use (for the leak checks of the tests).
    #[cfg(test)]
    fn slots_in_use(&self) -> usize {
        self.input_slots
            .iter()
            .filter(|s| **s != InSlot::Free)
            .count()
            + self
                .feature_slots
                .iter()
                .filter(|s| **s != FeatSlot::Free)
                .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One thing that can happen to the pipeline.
    #[derive(Debug, Clone)]
    enum Op {
        Feed,
        /// Target `n % targets` asks for work.
        Lease(usize),
        /// Target `n % targets` finishes its forward.
        Forward(usize),
        LeaseTrain,
        Train,
        Commit,
        /// Worker `n % workers` dies.
        Crash(usize),
        /// The drafter resumes `n % (committed + 1)` batches back (once no lease is out).
        Rewind(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Feed),
            3 => any::<usize>().prop_map(Op::Lease),
            3 => any::<usize>().prop_map(Op::Forward),
            3 => Just(Op::LeaseTrain),
            3 => Just(Op::Train),
            3 => Just(Op::Commit),
            1 => any::<usize>().prop_map(Op::Crash),
            1 => any::<usize>().prop_map(Op::Rewind),
        ]
    }

    /// Checks the invariants that hold between any two operations.
    fn check(d: &Dispatch) {
        // A batch is in at most one input slot and one feature slot, and each lease matches.
        let mut seen_in = BTreeSet::new();
        for s in &d.input_slots {
            if let InSlot::Filled(b) | InSlot::Leased(b) = s {
                assert!(seen_in.insert(*b), "batch {b} in two input slots");
            }
        }
        let mut seen_feat = BTreeSet::new();
        for s in &d.feature_slots {
            if let FeatSlot::Forwarding(b)
            | FeatSlot::Ready(b)
            | FeatSlot::Training(b)
            | FeatSlot::Trained(b) = s
            {
                assert!(seen_feat.insert(*b), "batch {b} in two feature slots");
            }
        }
        let mut leased = BTreeSet::new();
        for lease in d.leases.iter().flatten() {
            assert!(leased.insert(lease.batch()), "batch leased twice");
            match *lease {
                Lease::Forward {
                    batch,
                    input,
                    feature,
                } => {
                    assert_eq!(d.input_slots[input as usize], InSlot::Leased(batch));
                    assert_eq!(
                        d.feature_slots[feature as usize],
                        FeatSlot::Forwarding(batch)
                    );
                }
                Lease::Train { batch, feature } => {
                    assert_eq!(d.feature_slots[feature as usize], FeatSlot::Training(batch));
                }
            }
        }
        // Every slot in use belongs to a batch that is fed and not committed.
        for b in seen_in.iter().chain(&seen_feat) {
            assert!(*b >= d.next_commit && *b < d.next_feed, "stale batch {b}");
        }
        // The queue is in plan order.
        assert!(
            d.queue
                .iter()
                .zip(d.queue.iter().skip(1))
                .all(|(a, b)| a < b)
        );
    }

    /// Drives a pipeline with `targets` targets and one drafter through `ops`, then to the end of
    /// the epoch; returns the commits (a rewind truncates them).
    fn drive(batches: usize, targets: usize, ops: &[Op]) -> (Vec<usize>, Dispatch) {
        let workers = targets + 1;
        let drafter = targets;
        let mut d = Dispatch::new(2 * targets + 1, 2 * targets + 2, workers);
        d.enter(batches, 0);
        let mut commits: Vec<usize> = Vec::new();
        let apply = |d: &mut Dispatch, op: &Op, commits: &mut Vec<usize>| {
            match *op {
                Op::Feed => {
                    d.feed();
                }
                Op::Lease(n) => {
                    if let Some(job) = d.lease_forward(n % targets) {
                        assert!(job.batch >= d.next_commit);
                    }
                }
                Op::Forward(n) => {
                    let _ = d.forwarded(n % targets);
                }
                Op::LeaseTrain => {
                    if let Some(job) = d.lease_train(drafter) {
                        // Strictly in plan order: everything before it is trained or committed.
                        assert!(job.batch >= d.next_commit);
                    }
                }
                Op::Train => {
                    let _ = d.trained(drafter);
                }
                Op::Commit => {
                    while let Some(b) = d.commit_next() {
                        assert_eq!(b, commits.len(), "commit out of plan order");
                        commits.push(b);
                    }
                }
                Op::Crash(n) => {
                    d.reclaim(n % workers);
                }
                Op::Rewind(n) => {
                    // The run drains leases before repositioning.
                    for w in 0..workers {
                        d.reclaim(w);
                    }
                    let back = n % (commits.len() + 1);
                    let to = commits.len() - back;
                    commits.truncate(to);
                    d.enter(batches, to);
                }
            }
            check(d);
        };
        for op in ops {
            apply(&mut d, op, &mut commits);
        }
        // Then run to the end without faults: everything must complete.
        let finish = [
            Op::Feed,
            Op::Lease(0),
            Op::Lease(1),
            Op::Forward(0),
            Op::Forward(1),
            Op::LeaseTrain,
            Op::Train,
            Op::Commit,
        ];
        let mut rounds = 0;
        while commits.len() < batches {
            for op in &finish {
                apply(&mut d, op, &mut commits);
            }
            // Other targets' leases from the faulted phase: finish them too.
            for t in 0..targets {
                let _ = d.forwarded(t);
            }
            rounds += 1;
            assert!(rounds < 10 * batches + 100, "the pipeline stalled");
        }
        (commits, d)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn every_batch_is_committed_once_in_plan_order_and_no_slot_leaks(
            batches in 1usize..40,
            targets in 1usize..5,
            ops in proptest::collection::vec(op(), 0..300),
        ) {
            let (commits, d) = drive(batches, targets, &ops);
            prop_assert_eq!(commits, (0..batches).collect::<Vec<_>>());
            prop_assert!(!d.holds_leases());
            prop_assert_eq!(d.slots_in_use(), 0, "slots leaked");
            prop_assert!(d.queue.is_empty() && d.to_train.is_empty());
        }
    }

    #[test]
    fn a_result_for_work_not_given_is_refused() {
        let mut d = Dispatch::new(3, 4, 2);
        d.enter(5, 0);
        assert_eq!(d.forwarded(0), Err(NotLeased));
        assert_eq!(d.trained(1), Err(NotLeased));
        d.feed();
        let job = d.lease_forward(0).unwrap();
        assert_eq!(
            d.trained(0),
            Err(NotLeased),
            "a forward lease is not a train lease"
        );
        assert_eq!(d.forwarded(0), Ok(job.batch));
    }

    #[test]
    fn a_reclaimed_forward_goes_back_to_the_front() {
        let mut d = Dispatch::new(3, 4, 3);
        d.enter(10, 0);
        while d.feed().is_some() {}
        let first = d.lease_forward(0).unwrap();
        let second = d.lease_forward(1).unwrap();
        assert_eq!((first.batch, second.batch), (0, 1));
        d.reclaim(0);
        let again = d.lease_forward(0).unwrap();
        assert_eq!(again.batch, 0, "the reclaimed batch is next");
        assert_ne!(
            again.feature.generation, first.feature.generation,
            "a reused feature slot gets a new generation"
        );
    }
}
