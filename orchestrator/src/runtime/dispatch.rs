//! The slot and lease state machine: which batch sits in which shared-memory slot, which worker
//! holds which batch, and the plan-order cursors (fed, trained, committed). A plain struct with no
//! I/O, so property tests drive it through random feed/lease/crash/rewind sequences; the run loop
//! calls it and does the writing, publishing and sending.
//!
//! The guarantees: a batch is handed to at most one worker at a time, each drafter gets its
//! batches strictly in plan order (with data-parallel drafters, [`Assignment::ByPosition`]: a
//! batch goes to the drafter its position in its accumulation group names, whatever the timing), batches are committed exactly once and in plan order (a rewind voids
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
    /// A data-parallel drafter's part in the step of a short last group holding no batch of
    /// its rank ([`Assignment::ByPosition`]): `key` is the rank's place in that group (past the
    /// epoch's end), `era` the epoch entry it belongs to (the lease may outlive the epoch).
    Step {
        key: usize,
        era: u64,
    },
}

impl Lease {
    /// The batch of the lease (a step's: the epoch's last).
    pub fn batch(self) -> usize {
        match self {
            Lease::Forward { batch, .. } | Lease::Train { batch, .. } => batch,
            Lease::Step { key, .. } => key,
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

/// Which drafter trains which batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Any drafter that asks takes the next batch in plan order (one drafter; the synthetic
    /// stage's drafters).
    Any,
    /// Data-parallel drafters, workers `first..first + drafters`: batch `b` of the epoch sits at
    /// position `b % accum` of its accumulation group and goes to drafter rank
    /// `(b % accum) % world`, so the arithmetic of a step does not depend on who was free. The
    /// workers are ranks `base..base + drafters` of the `world` ranks of every node (one node:
    /// `base` 0, `world` = `drafters`); the other nodes' batches are neither fed nor trained
    /// here, and pass the commit cursor as their turn comes.
    ByPosition {
        first: usize,
        drafters: usize,
        accum: usize,
        base: usize,
        world: usize,
    },
}

impl Assignment {
    /// The rank among this node's drafters that trains `batch` (`None`: any drafter, or another
    /// node's).
    pub fn rank_of(self, batch: usize) -> Option<usize> {
        match self {
            Assignment::Any => None,
            Assignment::ByPosition {
                drafters,
                accum,
                base,
                world,
                ..
            } => ((batch % accum.max(1)) % world.max(1))
                .checked_sub(base)
                .filter(|&r| r < drafters),
        }
    }

    /// Whether this node trains `batch`.
    pub fn is_local(self, batch: usize) -> bool {
        matches!(self, Assignment::Any) || self.rank_of(batch).is_some()
    }
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
    /// The next batch the drafter gets (plan order; [`Assignment::Any`]).
    next_train: usize,
    /// Per drafter rank, the first batch it may still be given ([`Assignment::ByPosition`]).
    rank_next: Vec<usize>,
    assignment: Assignment,
    next_commit: usize,
    /// Where the epoch was entered, and how many entries there were.
    entered: usize,
    era: u64,
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
            rank_next: Vec::new(),
            assignment: Assignment::Any,
            next_commit: 0,
            entered: 0,
            era: 0,
            input_slots: vec![InSlot::Free; input_slots],
            input_generation: vec![0; input_slots],
            feature_slots: vec![FeatSlot::Free; feature_slots],
            feature_generation: vec![0; feature_slots],
            leases: vec![None; workers],
        }
    }

    /// Hands training batches out by `assignment` (default [`Assignment::Any`]).
    pub fn with_assignment(mut self, assignment: Assignment) -> Self {
        if let Assignment::ByPosition { drafters, .. } = assignment {
            self.rank_next = vec![self.next_train; drafters.max(1)];
        }
        self.assignment = assignment;
        self
    }

    /// An empty pipeline positioned at `batch` of an epoch of `batches` batches: nothing fed,
    /// queued or leased. Call only when no worker holds a lease but a data-parallel drafter's
    /// step of the epoch left (its answer may come after the last commit).
    pub fn enter(&mut self, batches: usize, batch: usize) {
        debug_assert!(
            self.leases
                .iter()
                .all(|l| matches!(l, None | Some(Lease::Step { .. }))),
            "entering with leases outstanding"
        );
        self.entered = batch;
        self.era += 1;
        self.batches = batches;
        self.batch_input = vec![u32::MAX; batches];
        self.next_feed = batch;
        self.next_train = batch;
        self.rank_next.fill(batch);
        self.next_commit = batch;
        self.queue.clear();
        self.to_train.clear();
        self.input_slots.fill(InSlot::Free);
        self.feature_slots.fill(FeatSlot::Free);
    }

    /// The next batch to feed and the free input slot it goes to, now marked filled; its
    /// generation is bumped (the caller writes the batch, then publishes with `generation`).
    pub fn feed(&mut self) -> Option<(usize, u32, u64)> {
        self.feed_below(usize::MAX)
    }

    /// [`Dispatch::feed`], of batches before `limit` only.
    pub fn feed_below(&mut self, limit: usize) -> Option<(usize, u32, u64)> {
        // Other nodes' batches are theirs to feed.
        while self.next_feed < self.batches.min(limit) && !self.assignment.is_local(self.next_feed)
        {
            self.next_feed += 1;
        }
        if self.next_feed >= self.batches.min(limit) {
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

    /// Drafter rank `rank`'s next place in plan order, from its cursor on: a batch to train
    /// (below the epoch's size), or its place in a short last group that holds no batch of its
    /// (at or past the size: the rank takes part in that group's step). `None`: nothing left.
    fn next_of_rank(&self, rank: usize) -> Option<usize> {
        let Assignment::ByPosition {
            drafters,
            accum,
            base,
            world,
            ..
        } = self.assignment
        else {
            return None;
        };
        let (world, accum) = (world.max(1), accum.max(1));
        // Its rank among every node's drafters.
        let g = base + rank;
        if rank >= drafters || g >= world || g >= accum {
            return None; // a rank past the group's size has no position in any group
        }
        let from = *self.rank_next.get(rank)?;
        let (group, pos) = (from / accum, from % accum);
        // The first position from `pos` on that is `g` modulo `world`.
        let p = pos + (g + world - pos % world) % world;
        let at = if p < accum {
            group * accum + p
        } else {
            (group + 1) * accum + g
        };
        if at < self.batches {
            return Some(at);
        }
        // Past the end: its group exists, starts after the entry (a group before it is done),
        // and this is the rank's first place in it.
        let start = at - at % accum;
        (start < self.batches && start >= self.entered && at % accum == g).then_some(at)
    }

    /// The end of the accumulation group of plan place `at` (a step's place included).
    fn group_end(&self, at: usize) -> usize {
        let accum = match self.assignment {
            Assignment::ByPosition { accum, .. } => accum.max(1),
            Assignment::Any => 1,
        };
        (at - at % accum + accum).min(self.batches)
    }

    /// Data-parallel drafters: the step boundary they can all stop at, the end of the furthest
    /// group any rank has started (the epoch's entry when none has).
    pub fn step_boundary(&self) -> usize {
        match self.rank_next.iter().max() {
            Some(&next) if next > self.entered => self.group_end(next - 1),
            _ => self.entered,
        }
    }

    /// Whether every data-parallel drafter rank stands at [`Dispatch::step_boundary`]: none
    /// holds work, and none has a batch or a step left before it (always true for
    /// [`Assignment::Any`]).
    pub fn drafters_at_step_boundary(&self) -> bool {
        let Assignment::ByPosition {
            first, drafters, ..
        } = self.assignment
        else {
            return true;
        };
        let boundary = self.step_boundary();
        let accum = match self.assignment {
            Assignment::ByPosition { accum, .. } => accum.max(1),
            Assignment::Any => 1,
        };
        (0..drafters).all(|rank| {
            self.leases.get(first + rank).is_none_or(Option::is_none)
                && self
                    .next_of_rank(rank)
                    .is_none_or(|at| at - at % accum >= boundary)
        })
    }

    /// Leases data-parallel drafter `worker` its part in the step of a short last group that
    /// holds no batch of its rank, when that is its next place; returns the epoch's last batch.
    pub fn lease_step(&mut self, worker: usize) -> Option<usize> {
        let Assignment::ByPosition {
            first, drafters, ..
        } = self.assignment
        else {
            return None;
        };
        if self.leases[worker].is_some() {
            return None;
        }
        let rank = worker.checked_sub(first).filter(|&r| r < drafters)?;
        let key = self.next_of_rank(rank).filter(|&at| at >= self.batches)?;
        self.rank_next[rank] = key + 1;
        self.leases[worker] = Some(Lease::Step { key, era: self.era });
        Some(self.batches - 1)
    }

    /// Whether a drafter rank of this node has yet to take part in the step of the epoch's
    /// short last group (leased or not).
    fn owes_a_step(&self) -> bool {
        let Assignment::ByPosition {
            first, drafters, ..
        } = self.assignment
        else {
            return false;
        };
        (0..drafters).any(|rank| {
            matches!(
                self.leases.get(first + rank),
                Some(Some(Lease::Step { .. }))
            ) || self.next_of_rank(rank).is_some_and(|at| at >= self.batches)
        })
    }

    /// Drafter `worker` took part in its step.
    pub fn stepped(&mut self, worker: usize) -> Result<(), NotLeased> {
        match self.leases[worker] {
            Some(Lease::Step { .. }) => {
                self.leases[worker] = None;
                Ok(())
            }
            _ => Err(NotLeased),
        }
    }

    /// Leases drafter `worker` its next batch in plan order (the next of all with
    /// [`Assignment::Any`], the next of its rank's with [`Assignment::ByPosition`]), if its
    /// features are ready.
    pub fn lease_train(&mut self, worker: usize) -> Option<TrainJob> {
        if self.leases[worker].is_some() {
            return None;
        }
        let batch = match self.assignment {
            Assignment::Any => {
                let &batch = self.to_train.first()?;
                if batch != self.next_train {
                    return None; // strictly in plan order
                }
                batch
            }
            Assignment::ByPosition {
                first, drafters, ..
            } => {
                let rank = worker.checked_sub(first).filter(|&r| r < drafters)?;
                let batch = self.next_of_rank(rank)?;
                if batch >= self.batches || !self.to_train.contains(&batch) {
                    return None; // its rank's next, strictly in plan order
                }
                batch
            }
        };
        let feature = self
            .feature_slots
            .iter()
            .position(|s| *s == FeatSlot::Ready(batch))?;
        match self.assignment.rank_of(batch) {
            None => self.next_train += 1,
            Some(rank) => self.rank_next[rank] = batch + 1,
        }
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
        if b < self.batches && !self.assignment.is_local(b) {
            // Another node's: its drafters train it in the same steps as this node's. Every
            // batch of this node before it is committed, so this node's ranks have passed it,
            // but for their part in the step of a short last group: the epoch's last batch
            // waits for that.
            if b + 1 == self.batches && self.owes_a_step() {
                return None;
            }
            self.next_commit += 1;
            return Some(b);
        }
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
        for next in &mut self.rank_next {
            *next = (*next).max(self.next_commit);
        }
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
                match self.assignment.rank_of(batch) {
                    None => self.next_train = self.next_train.min(batch),
                    Some(rank) => self.rank_next[rank] = self.rank_next[rank].min(batch),
                }
            }
            Lease::Step { key, era } => {
                if let (true, Some(rank)) = (era == self.era, self.assignment.rank_of(key)) {
                    self.rank_next[rank] = self.rank_next[rank].min(key);
                }
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
        /// Drafter `n % drafters` asks for work.
        LeaseTrain(usize),
        /// Drafter `n % drafters` finishes its batch.
        Train(usize),
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
            3 => any::<usize>().prop_map(Op::LeaseTrain),
            3 => any::<usize>().prop_map(Op::Train),
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
                Lease::Step { key, .. } => {
                    assert!(key >= d.batches, "a step lease inside the epoch: {key}");
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

    /// Drives a pipeline with `targets` targets and `drafters` drafters handed batches by
    /// `assignment` through `ops`, then to the end of the epoch; returns the commits (a rewind
    /// truncates them). Checks on the way that each drafter gets only its own batches
    /// (`ByPosition`), each in plan order until it crashes or the run rewinds.
    fn drive_with(
        batches: usize,
        targets: usize,
        drafters: usize,
        assignment: Assignment,
        ops: &[Op],
    ) -> (Vec<usize>, Dispatch) {
        let workers = targets + drafters;
        let mut d =
            Dispatch::new(2 * targets + 1, 2 * targets + 2, workers).with_assignment(assignment);
        d.enter(batches, 0);
        let mut commits: Vec<usize> = Vec::new();
        // Per drafter, the last batch it was given since its last restart, and whether it took
        // part in the step of a short last group holding none of its batches.
        let mut last: Vec<Option<usize>> = vec![None; drafters];
        let mut stepped = vec![false; drafters];
        let apply = |d: &mut Dispatch,
                     op: &Op,
                     commits: &mut Vec<usize>,
                     last: &mut Vec<Option<usize>>,
                     stepped: &mut Vec<bool>| {
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
                Op::LeaseTrain(n) => {
                    let rank = n % drafters;
                    if let Some(job) = d.lease_train(targets + rank) {
                        assert!(job.batch >= d.next_commit);
                        if let Some(owner) = assignment.rank_of(job.batch) {
                            assert_eq!(owner, rank, "batch {} given to another rank", job.batch);
                        }
                        if let Some(before) = last[rank] {
                            assert!(
                                job.batch > before,
                                "rank {rank}: {before} then {}",
                                job.batch
                            );
                        }
                        last[rank] = Some(job.batch);
                    } else if let Some(last_batch) = d.lease_step(targets + rank) {
                        let Assignment::ByPosition { accum, base, .. } = assignment else {
                            panic!("a step lease without data-parallel drafters");
                        };
                        let len = batches - (batches - 1) / accum * accum;
                        assert_eq!(last_batch, batches - 1);
                        assert!(
                            base + rank >= len,
                            "rank {rank} has a batch in the last group of {len}"
                        );
                        assert!(!stepped[rank], "rank {rank} given the step twice");
                    }
                }
                Op::Train(n) => {
                    let w = targets + n % drafters;
                    if d.stepped(w).is_ok() {
                        stepped[n % drafters] = true;
                    } else {
                        let _ = d.trained(w);
                    }
                }
                Op::Commit => {
                    while let Some(b) = d.commit_next() {
                        assert_eq!(b, commits.len(), "commit out of plan order");
                        commits.push(b);
                        if let (true, Assignment::ByPosition { accum, base, .. }) =
                            (b + 1 == batches && !assignment.is_local(b), assignment)
                        {
                            // Another node's last batch ends the epoch only once this node's
                            // ranks without a batch in its short last group took their part.
                            let start = (batches - 1) / accum * accum;
                            for (rank, &done) in stepped.iter().enumerate() {
                                assert!(
                                    done || base + rank < batches - start || d.entered > start,
                                    "the epoch ended before rank {rank}'s step"
                                );
                            }
                        }
                    }
                }
                Op::Crash(n) => {
                    let w = n % workers;
                    d.reclaim(w);
                    if w >= targets {
                        last[w - targets] = None;
                    }
                }
                Op::Rewind(n) => {
                    // The run drains leases before repositioning.
                    for w in 0..workers {
                        d.reclaim(w);
                    }
                    last.fill(None);
                    stepped.fill(false);
                    // A drafter resumes inside the epoch (its end is the next one's start).
                    let back = n % (commits.len() + 1);
                    let to = (commits.len() - back).min(batches - 1);
                    commits.truncate(to);
                    d.enter(batches, to);
                }
            }
            check(d);
        };
        for op in ops {
            apply(&mut d, op, &mut commits, &mut last, &mut stepped);
        }
        // Then run to the end without faults: everything must complete.
        let mut finish = vec![
            Op::Feed,
            Op::Lease(0),
            Op::Lease(1),
            Op::Forward(0),
            Op::Forward(1),
        ];
        finish.extend((0..drafters).flat_map(|r| [Op::LeaseTrain(r), Op::Train(r)]));
        finish.push(Op::Commit);
        let mut rounds = 0;
        while commits.len() < batches {
            for op in &finish {
                apply(&mut d, op, &mut commits, &mut last, &mut stepped);
            }
            // Other targets' leases from the faulted phase: finish them too.
            for t in 0..targets {
                let _ = d.forwarded(t);
            }
            rounds += 1;
            assert!(rounds < 10 * batches + 100, "the pipeline stalled");
        }
        // The ranks without a batch in a short last group take part in its step; then every
        // rank stands at the epoch's end.
        for r in 0..drafters {
            apply(
                &mut d,
                &Op::LeaseTrain(r),
                &mut commits,
                &mut last,
                &mut stepped,
            );
            apply(&mut d, &Op::Train(r), &mut commits, &mut last, &mut stepped);
        }
        if let Assignment::ByPosition {
            accum,
            base,
            drafters,
            world,
            ..
        } = assignment
        {
            let len = batches - (batches - 1) / accum * accum;
            for (rank, &done) in stepped.iter().enumerate() {
                // A rewind after the step voids it; one into the last group brings it back.
                if base + rank >= len && d.entered <= (batches - 1) / accum * accum {
                    assert!(
                        done,
                        "rank {rank} never stepped with the short last group of {len}"
                    );
                }
            }
            assert!(d.drafters_at_step_boundary());
            if world == drafters {
                assert_eq!(d.step_boundary(), batches.max(d.entered));
            } else {
                // A node entered past its ranks' last places stands at its entry.
                let b = d.step_boundary();
                assert!(b == d.entered || b == batches, "boundary {b}");
            }
        }
        (commits, d)
    }

    fn drive(batches: usize, targets: usize, ops: &[Op]) -> (Vec<usize>, Dispatch) {
        drive_with(batches, targets, 1, Assignment::Any, ops)
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

        /// Data-parallel drafters: every batch trained and committed once, in plan order; each
        /// drafter given only the batches its rank owns, in plan order; no slot leaks; under
        /// random crashes of any worker and rewinds. On one node of several, the other nodes'
        /// batches pass the commit cursor untrained here.
        #[test]
        fn data_parallel_drafters_train_their_own_batches_in_plan_order(
            batches in 1usize..40,
            targets in 1usize..4,
            drafters in 1usize..4,
            accum in 1usize..7,
            nodes in 1usize..4,
            node in 0usize..3,
            ops in proptest::collection::vec(op(), 0..300),
        ) {
            // A rank past the group's size has nothing to train: a run has no such rank.
            let nodes = nodes.min(accum);
            let drafters = drafters.min(accum / nodes);
            let node = node % nodes;
            let assignment = Assignment::ByPosition {
                first: targets,
                drafters,
                accum,
                base: node * drafters,
                world: nodes * drafters,
            };
            let (commits, d) = drive_with(batches, targets, drafters, assignment, &ops);
            prop_assert_eq!(commits, (0..batches).collect::<Vec<_>>());
            prop_assert!(!d.holds_leases());
            prop_assert_eq!(d.slots_in_use(), 0, "slots leaked");
            prop_assert!(d.queue.is_empty() && d.to_train.is_empty());
        }
    }

    /// The assignment is by position in the accumulation group: with `--accum 4` and two
    /// drafters, ranks 0, 1, 0, 1 in every group, the next group starting again at rank 0; a
    /// rank's cursor skips the others' batches and goes back to a reclaimed one.
    #[test]
    fn batches_go_to_the_rank_their_group_position_names() {
        let a = Assignment::ByPosition {
            first: 1,
            drafters: 2,
            accum: 4,
            base: 0,
            world: 2,
        };
        let ranks: Vec<_> = (0..10).map(|b| a.rank_of(b).unwrap()).collect();
        assert_eq!(ranks, [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
        let three = Assignment::ByPosition {
            first: 1,
            drafters: 2,
            accum: 3,
            base: 0,
            world: 2,
        };
        let ranks: Vec<_> = (0..7).map(|b| three.rank_of(b).unwrap()).collect();
        assert_eq!(ranks, [0, 1, 0, 0, 1, 0, 0]);
        assert_eq!(Assignment::Any.rank_of(5), None);

        let mut d = Dispatch::new(8, 8, 3).with_assignment(three);
        d.enter(7, 0);
        while d.feed().is_some() {}
        for _ in 0..7 {
            if d.lease_forward(0).is_some() {
                d.forwarded(0).unwrap();
            }
        }
        // Rank 1 (worker 2) gets batch 1, then 4; rank 0 (worker 1) gets 0, 2, 3.
        assert_eq!(d.lease_train(2).unwrap().batch, 1);
        d.trained(2).unwrap();
        assert_eq!(d.lease_train(2).unwrap().batch, 4);
        assert_eq!(d.lease_train(1).unwrap().batch, 0);
        d.trained(1).unwrap();
        assert_eq!(d.lease_train(1).unwrap().batch, 2);
        // Rank 1 crashes holding batch 4: it gets 4 again, not 5's rank-0 batch.
        d.reclaim(2);
        assert_eq!(d.lease_train(2).unwrap().batch, 4);
        // The target worker is no drafter.
        assert!(d.lease_train(0).is_none());
    }

    /// A short last group with fewer batches than drafters: the rank without a batch in it is
    /// given its part in the group's step (once), and the ranks stand at a step boundary only
    /// when every group any of them started is done.
    #[test]
    fn a_rank_without_a_batch_in_the_last_group_takes_part_in_its_step() {
        let a = Assignment::ByPosition {
            first: 1,
            drafters: 2,
            accum: 4,
            base: 0,
            world: 2,
        };
        // 9 batches: groups 0..4, 4..8 and 8..9.
        let mut d = Dispatch::new(16, 16, 3).with_assignment(a);
        d.enter(9, 0);
        assert!(d.drafters_at_step_boundary());
        while d.feed().is_some() {}
        while d.lease_forward(0).is_some() {
            d.forwarded(0).unwrap();
        }
        assert_eq!(d.lease_step(2), None, "rank 1 has batches before");
        assert_eq!(d.lease_train(1).unwrap().batch, 0);
        assert_eq!(d.step_boundary(), 4);
        assert!(!d.drafters_at_step_boundary(), "a group is started");
        d.trained(1).unwrap();
        for (worker, batch) in [(2, 1), (1, 2), (2, 3)] {
            assert_eq!(d.lease_train(worker).unwrap().batch, batch);
            d.trained(worker).unwrap();
        }
        assert!(d.drafters_at_step_boundary(), "group 0..4 is done");
        for (worker, batch) in [(1, 4), (2, 5), (1, 6), (2, 7), (1, 8)] {
            assert_eq!(d.lease_train(worker).unwrap().batch, batch);
            d.trained(worker).unwrap();
        }
        assert!(
            !d.drafters_at_step_boundary(),
            "rank 1 owes group 8..9 its step"
        );
        assert_eq!(d.lease_train(2), None);
        assert_eq!(d.lease_step(2), Some(8));
        assert_eq!(d.lease_step(2), None, "one lease at a time");
        // Its death gives the step back; the next process takes it again.
        assert!(matches!(d.reclaim(2), Some(Lease::Step { key: 9, .. })));
        assert_eq!(d.lease_step(2), Some(8));
        assert_eq!(d.trained(2), Err(NotLeased), "a step is no training");
        d.stepped(2).unwrap();
        assert_eq!(d.stepped(2), Err(NotLeased));
        assert_eq!(d.lease_step(2), None, "once");
        assert!(d.drafters_at_step_boundary());
        assert_eq!(d.step_boundary(), 9);
        // A run that resumes past the short group's start does not take its step again.
        d.enter(9, 8);
        assert_eq!(
            d.lease_step(2),
            Some(8),
            "resumed at the group's start: the step is due"
        );
        d.stepped(2).unwrap();
        d.enter(9, 9);
        assert_eq!(d.lease_step(2), None);
    }

    /// Two nodes of one drafter each (`--accum 4`, 9 batches): each feeds and trains only the
    /// batches of its rank, both commit the whole plan in order, and the node without a batch
    /// in the short last group takes part in its step.
    #[test]
    fn two_nodes_split_every_group_and_commit_the_whole_plan() {
        let mut trained: Vec<Vec<usize>> = Vec::new();
        for node in 0..2 {
            let a = Assignment::ByPosition {
                first: 1,
                drafters: 1,
                accum: 4,
                base: node,
                world: 2,
            };
            let mut d = Dispatch::new(4, 4, 2).with_assignment(a);
            d.enter(9, 0);
            let (mut mine, mut fed, mut commits) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..40 {
                while let Some((b, ..)) = d.feed() {
                    fed.push(b);
                }
                if d.lease_forward(0).is_some() {
                    d.forwarded(0).unwrap();
                }
                if let Some(job) = d.lease_train(1) {
                    mine.push(job.batch);
                    d.trained(1).unwrap();
                }
                while let Some(b) = d.commit_next() {
                    commits.push(b);
                }
            }
            assert_eq!(fed, mine, "node {node} feeds only what it trains");
            let step = d.lease_step(1);
            assert_eq!(
                step.is_some(),
                node == 1,
                "node {node}: the short group's step"
            );
            if step.is_some() {
                // The epoch's last batch (node 0's) waits for node 1's part in its step.
                assert_eq!(commits, (0..8).collect::<Vec<_>>(), "node {node}");
                assert_eq!(d.commit_next(), None, "node 1 has not stepped");
                d.stepped(1).unwrap();
                commits.extend(d.commit_next());
            }
            assert_eq!(commits, (0..9).collect::<Vec<_>>(), "node {node}");
            assert!(d.drafters_at_step_boundary());
            assert!(!d.holds_leases() && d.slots_in_use() == 0);
            trained.push(mine);
        }
        assert_eq!(trained[0], [0, 2, 4, 6, 8]);
        assert_eq!(trained[1], [1, 3, 5, 7]);
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
