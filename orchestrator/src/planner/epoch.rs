//! The shuffle-and-pack core of an epoch, on two threads where the machine has them.
//!
//! Samples are shuffled by Rao–Sandelius (random piles, then each pile shuffled; see
//! [`PlanRng::scatter`]) into one buffer of `[index, length]` pairs, every bucket in its own span.
//! Each pile is shuffled with its own random stream, so the result does not depend on how piles
//! are spread over threads: the piles of the buffer's second half are shuffled on a helper thread
//! while this thread shuffles and packs the first half, then packs the rest.

use super::pack::PaddedRun;
use super::rng::PlanRng;
use super::{Batch, Pair};
use crate::parallel::both;

/// One pile of one bucket: item positions `start..end` of the pair buffer.
#[derive(Debug, Clone, Copy)]
pub struct Pile {
    pub bucket: u16,
    pub start: usize,
    pub end: usize,
}

/// Buffers at least this large are worth huge pages.
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// Asks Linux to back a large fresh buffer with transparent huge pages: mapping megabytes of
/// planning buffer page by page costs more than planning into it (measured: 7 MB took 2.5 ms in
/// 4 KiB faults, 1 ms with huge pages). Advice only: without THP nothing changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages<T>(buf: &mut [T]) {
    let len = std::mem::size_of_val(buf);
    if len < HUGE_PAGE_MIN_BYTES {
        return;
    }
    let start = buf.as_mut_ptr() as usize;
    let begin = start.next_multiple_of(4096);
    let end = (start + len) / 4096 * 4096;
    // SAFETY: [begin, end) is page-aligned and lies inside `buf`, a live allocation we hold
    // exclusively; MADV_HUGEPAGE changes how its not-yet-touched pages are backed, never their
    // contents. A failure (THP not built in) is harmless and ignored.
    unsafe {
        libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_buf: &mut [T]) {}

/// Touches every page of a fresh buffer from two threads, so the kernel maps it in parallel.
pub fn prefault(pairs: &mut [Pair]) {
    advise_huge_pages(pairs);
    const PAIRS_PER_PAGE: usize = 4096 / std::mem::size_of::<Pair>();
    let (lo, hi) = pairs.split_at_mut(pairs.len() / 2);
    let touch = |part: &mut [Pair]| {
        for chunk in part.chunks_mut(PAIRS_PER_PAGE) {
            chunk[0] = [0, 0];
        }
    };
    both(|| touch(lo), || touch(hi));
}

/// Piles per bucket in the first step of the shuffle.
const PILES: usize = 256;

/// Every kept sample (`lengths[i] > 0`) as an `[index, length]` pair, each bucket in its own span
/// (buckets in order, of `sizes[b]` samples) and, within it, in one of 256 piles drawn uniformly
/// at random. Shuffling every pile then completes a uniform shuffle of every bucket
/// (Rao–Sandelius), one cache-sized pile at a time. Returns the pairs and the non-empty piles.
pub fn scatter(
    lengths: &[u32],
    bucket_of: &[u16],
    sizes: &[usize],
    rng: &mut PlanRng,
) -> (Vec<Pair>, Vec<Pile>) {
    let kept: usize = sizes.iter().sum();
    // Pile of the j-th kept sample: byte j % 8 of the (j / 8)-th draw, drawn twice from the same
    // state (count, then place) instead of being stored.
    let kept_with_piles = |mut rng: PlanRng| {
        let mut word = 0u64;
        let mut j = 0usize;
        lengths
            .iter()
            .enumerate()
            .filter(|&(_, &len)| len > 0)
            .map(move |(i, &len)| {
                if j.is_multiple_of(8) {
                    word = rng.next_u64();
                }
                let pile = usize::from((word >> (8 * (j % 8))) as u8);
                j += 1;
                let b = usize::from(bucket_of[len as usize]);
                (b * PILES + pile, [i as u32, len])
            })
    };
    let mut fill = vec![0usize; sizes.len() * PILES];
    for (slot, _) in kept_with_piles(rng.clone()) {
        fill[slot] += 1;
    }
    let mut piles = Vec::new();
    let mut start = 0;
    for (slot, count) in fill.iter_mut().enumerate() {
        let end = start + *count;
        if end > start {
            piles.push(Pile {
                bucket: (slot / PILES) as u16,
                start,
                end,
            });
        }
        *count = start;
        start = end;
    }
    let mut pairs = vec![[0u32; 2]; kept];
    prefault(&mut pairs);
    for (slot, pair) in kept_with_piles(rng.clone()) {
        pairs[fill[slot]] = pair;
        fill[slot] += 1;
    }
    for _ in 0..kept.div_ceil(8) {
        rng.next_u64();
    }
    (pairs, piles)
}

/// The random stream that shuffles pile `k` of an epoch.
fn pile_rng(base: u64, k: usize) -> PlanRng {
    PlanRng::from_seed(base ^ (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn shuffle_pile(buf: &mut [u32], offset: usize, pile: &Pile, rng: &mut PlanRng) {
    let region = &mut buf[2 * (pile.start - offset)..2 * (pile.end - offset)];
    rng.shuffle(bytemuck::cast_slice_mut::<u32, Pair>(region));
}

/// The first pile of the buffer's second half (by items).
fn split_point(piles: &[Pile]) -> usize {
    let total = piles.last().map_or(0, |p| p.end);
    piles.partition_point(|p| p.end <= total / 2)
}

/// Shuffles every pile of `buf` (pairs as u32s).
pub fn shuffle_piles(buf: &mut [u32], piles: &[Pile], base: u64) {
    shuffle_visiting(buf, piles, base, |_, _| {});
}

/// Shuffles every pile and packs every bucket's span greedily (padded), in place: `buf` ends with
/// the samples of all batches in its first half. Returns each bucket's batches in packing order.
pub fn shuffle_and_pack(
    buf: &mut [u32],
    piles: &[Pile],
    buckets: usize,
    budget: u64,
    base: u64,
) -> Vec<Vec<Batch>> {
    let mut runs: Vec<Option<PaddedRun>> = (0..buckets).map(|_| None).collect();
    // Capacity for one batch per sample: address space only, and no batch is copied by growth.
    let mut sizes = vec![0usize; buckets];
    for pile in piles {
        sizes[usize::from(pile.bucket)] += pile.end - pile.start;
    }
    let mut batches: Vec<Vec<Batch>> = sizes.iter().map(|&n| Vec::with_capacity(n)).collect();
    shuffle_visiting(buf, piles, base, |buf, pile| {
        let b = usize::from(pile.bucket);
        runs[b]
            .get_or_insert_with(|| PaddedRun::new(budget, pile.bucket, pile.start))
            .feed(buf, pile.start, pile.end, &mut batches[b]);
    });
    for (b, run) in runs.into_iter().enumerate() {
        if let Some(run) = run {
            run.finish(&mut batches[b]);
        }
    }
    batches
}

/// Shuffles every pile of `buf`, the second half's on a helper thread, and hands each pile, once
/// shuffled, to `visit` in buffer order: the first half's as they are done, the rest after the
/// helper finishes. `visit` may write only at u32 offsets below the end of the pile's pairs
/// (in-place packing writes sample `t` at offset `t`), so the halves never overlap.
fn shuffle_visiting(
    buf: &mut [u32],
    piles: &[Pile],
    base: u64,
    mut visit: impl FnMut(&mut [u32], &Pile),
) {
    let s = split_point(piles);
    let mid = piles.get(s).map_or(buf.len() / 2, |p| p.start);
    {
        let (lo, hi) = buf.split_at_mut(2 * mid);
        both(
            || {
                for (k, pile) in piles[..s].iter().enumerate() {
                    shuffle_pile(lo, 0, pile, &mut pile_rng(base, k));
                    visit(lo, pile);
                }
            },
            || {
                for (k, pile) in piles.iter().enumerate().skip(s) {
                    shuffle_pile(hi, mid, pile, &mut pile_rng(base, k));
                }
            },
        );
    }
    for pile in &piles[s..] {
        visit(buf, pile);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shuffled(
        lengths: &[u32],
        bucket_of: &[u16],
        sizes: &[usize],
        seed: u64,
    ) -> (Vec<Pair>, Vec<Pile>) {
        let mut rng = PlanRng::from_seed(seed);
        let (mut pairs, piles) = scatter(lengths, bucket_of, sizes, &mut rng);
        shuffle_piles(bytemuck::cast_slice_mut(&mut pairs), &piles, rng.next_u64());
        (pairs, piles)
    }

    #[test]
    fn scatter_keeps_buckets_apart_and_every_sample_once() {
        // Lengths 1..=4 in two buckets: {1, 2} and {3, 4}; zeros are dropped samples.
        let lengths: Vec<u32> = (0..10_000).map(|i| (i % 5) as u32).collect();
        let bucket_of = [0, 0, 0, 1, 1];
        let sizes = [4000, 4000];
        let (pairs, piles) = shuffled(&lengths, &bucket_of, &sizes, 3);
        assert_eq!(pairs.len(), 8000);
        assert!(pairs[..4000].iter().all(|p| p[1] <= 2));
        assert!(pairs[4000..].iter().all(|p| p[1] >= 3));
        let mut seen: Vec<u32> = pairs.iter().map(|p| p[0]).collect();
        seen.sort_unstable();
        let expect: Vec<u32> = (0..10_000).filter(|i| i % 5 != 0).collect();
        assert_eq!(seen, expect);
        for p in &pairs {
            assert_eq!(p[1], lengths[p[0] as usize]);
        }
        assert!(piles.windows(2).all(|w| w[0].end == w[1].start));
    }

    /// Where sample 0 lands over many epochs: uniform over the bucket.
    #[test]
    fn shuffle_is_uniform() {
        let lengths = vec![1u32; 20_000];
        let mut hits = [0u32; 5];
        for seed in 0..500 {
            let (pairs, _) = shuffled(&lengths, &[0, 0], &[20_000], seed);
            let pos = pairs.iter().position(|p| p[0] == 0).unwrap();
            hits[pos * 5 / pairs.len()] += 1;
        }
        for h in hits {
            assert!((65..135).contains(&h), "{hits:?}");
        }
    }
}
