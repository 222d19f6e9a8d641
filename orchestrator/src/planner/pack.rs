//! Packing samples into batches under a token budget.
//!
//! Padded batches track the *running* maximum length of the open batch, so the budget holds for
//! samples in any order (the original packer assumed sorted input and took the newest sample's
//! length as the batch maximum). Packed (variable-length) batches fill the budget with real tokens:
//! samples are taken in their random order and the last gap of each batch is filled best-fit from a
//! bounded look-ahead, so efficiency comes from filling, not from sorting by length.

use super::{Batch, Pair};

/// How many upcoming samples the varlen packer may choose from when filling a batch's last gap.
pub const PACK_LOOKAHEAD: usize = 512;

/// Samples with a length (> 0 in `lengths`) as `[index, length]` pairs in ascending (length, index)
/// order: a counting sort, O(n + longest).
pub fn length_order(lengths: &[u32], kept: usize, longest: u32) -> Vec<Pair> {
    let mut starts = vec![0usize; longest as usize + 2];
    for &len in lengths {
        if len > 0 {
            starts[len as usize + 1] += 1;
        }
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut order = vec![[0u32; 2]; kept];
    for (i, &len) in lengths.iter().enumerate() {
        if len > 0 {
            let slot = &mut starts[len as usize];
            order[*slot] = [i as u32, len];
            *slot += 1;
        }
    }
    order
}

/// The greedy padded packing rule, one sample at a time: a sample joins the open batch while
/// `(count + 1) × max(running_max, len) <= budget`, else it opens the next batch.
#[derive(Debug, Clone, Copy)]
pub struct PaddedPacker {
    budget: u64,
    count: u32,
    max_len: u32,
}

impl PaddedPacker {
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            count: 0,
            max_len: 0,
        }
    }

    /// Adds a sample; returns `(count, max_len)` of the batch it closed, if it closed one.
    #[inline]
    pub fn push(&mut self, len: u32) -> Option<(u32, u32)> {
        let new_max = self.max_len.max(len);
        if self.count > 0 && u64::from(self.count + 1) * u64::from(new_max) > self.budget {
            let closed = (self.count, self.max_len);
            (self.count, self.max_len) = (1, len);
            return Some(closed);
        }
        self.count += 1;
        self.max_len = new_max;
        None
    }

    /// The open batch's `(count, max_len)`.
    pub fn open(&self) -> (u32, u32) {
        (self.count, self.max_len)
    }
}

/// Greedy padded packing over a buffer of `[index, length]` pairs, in place: the pair at item
/// position `t` (u32 offsets `2t`, `2t + 1`) is read before the index is written to u32 offset `t`,
/// so the buffer turns into the plan's sample list as it is packed. Feed ranges in order.
pub struct PaddedRun {
    packer: PaddedPacker,
    bucket: u16,
    start: usize,
    real: u64,
}

impl PaddedRun {
    /// A run whose first sample will be item position `start`.
    pub fn new(budget: u64, bucket: u16, start: usize) -> Self {
        Self {
            packer: PaddedPacker::new(budget),
            bucket,
            start,
            real: 0,
        }
    }

    /// Packs item positions `from..to` of `buf` (pairs), writing indices to `buf[from..to]`.
    pub fn feed(&mut self, buf: &mut [u32], from: usize, to: usize, batches: &mut Vec<Batch>) {
        // Block by block through a copy on the stack: the pairs of a block are read before any of
        // its indices are written, and the loop runs without bounds checks.
        const BLOCK: usize = 512;
        let mut block = [[0u32; 2]; BLOCK];
        let mut t = from;
        while t < to {
            let n = BLOCK.min(to - t);
            let pairs: &[Pair] = bytemuck::cast_slice(&buf[2 * t..2 * (t + n)]);
            block[..n].copy_from_slice(pairs);
            for (k, (slot, &[index, len])) in buf[t..t + n].iter_mut().zip(&block[..n]).enumerate()
            {
                *slot = index;
                if let Some((count, max_len)) = self.packer.push(len) {
                    self.close(count, max_len, batches);
                    self.start = t + k;
                    self.real = 0;
                }
                self.real += u64::from(len);
            }
            t += n;
        }
    }

    fn close(&self, count: u32, max_len: u32, batches: &mut Vec<Batch>) {
        batches.push(Batch {
            bucket: self.bucket,
            start: self.start as u32,
            count,
            max_len,
            real_tokens: self.real,
        });
    }

    /// Closes the open batch.
    pub fn finish(self, batches: &mut Vec<Batch>) {
        let (count, max_len) = self.packer.open();
        if count > 0 {
            self.close(count, max_len, batches);
        }
    }
}

/// Sentinel for "no position" in the pending lists.
const NONE: u32 = u32::MAX;

/// The look-ahead window of the varlen packer: pending stream positions, grouped by length in
/// intrusive doubly linked lists, with a two-level bitmap of the lengths that have any. Insert,
/// remove and "a pending sample of the largest length <= x" are all O(1).
struct Pending {
    head: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Bit `len` set when some sample of that length is pending.
    lengths: Vec<u64>,
    /// Bit `w` set when word `w` of `lengths` is non-zero.
    words: Vec<u64>,
}

impl Pending {
    fn new(positions: usize, longest: u32) -> Self {
        let n_len = longest as usize + 1;
        let n_words = n_len.div_ceil(64);
        Self {
            head: vec![NONE; n_len],
            prev: vec![NONE; positions],
            next: vec![NONE; positions],
            lengths: vec![0; n_words],
            words: vec![0; n_words.div_ceil(64)],
        }
    }

    fn insert(&mut self, pos: u32, len: u32) {
        let l = len as usize;
        let first = self.head[l];
        self.next[pos as usize] = first;
        self.prev[pos as usize] = NONE;
        if first != NONE {
            self.prev[first as usize] = pos;
        } else {
            self.lengths[l / 64] |= 1 << (l % 64);
            self.words[l / 4096] |= 1 << ((l / 64) % 64);
        }
        self.head[l] = pos;
    }

    fn remove(&mut self, pos: u32, len: u32) {
        let l = len as usize;
        let (p, n) = (self.prev[pos as usize], self.next[pos as usize]);
        if p != NONE {
            self.next[p as usize] = n;
        } else {
            self.head[l] = n;
        }
        if n != NONE {
            self.prev[n as usize] = p;
        }
        if self.head[l] == NONE {
            self.lengths[l / 64] &= !(1 << (l % 64));
            if self.lengths[l / 64] == 0 {
                self.words[l / 4096] &= !(1 << ((l / 64) % 64));
            }
        }
    }

    /// The largest pending length <= `limit` (`limit` < number of lengths tracked).
    fn largest_le(&self, limit: usize) -> Option<u32> {
        let w = limit / 64;
        let in_word = self.lengths[w] & (u64::MAX >> (63 - limit % 64));
        if in_word != 0 {
            return Some((w * 64 + 63 - in_word.leading_zeros() as usize) as u32);
        }
        // Highest non-empty word below w, through the summary bitmap.
        let mut sw = w / 64;
        let mut mask = if w.is_multiple_of(64) {
            0
        } else {
            u64::MAX >> (64 - w % 64)
        };
        loop {
            let bits = self.words[sw] & mask;
            if bits != 0 {
                let word = sw * 64 + 63 - bits.leading_zeros() as usize;
                let l = self.lengths[word];
                return Some((word * 64 + 63 - l.leading_zeros() as usize) as u32);
            }
            if sw == 0 {
                return None;
            }
            sw -= 1;
            mask = u64::MAX;
        }
    }
}

/// Variable-length packing: real tokens per batch <= `budget`. Samples enter a look-ahead window of
/// [`PACK_LOOKAHEAD`] in `order`; each batch takes the oldest pending sample while it fits, then
/// fills the remaining gap with a pending sample of the largest length that fits, until none does.
/// `longest` bounds the lengths in `order`.
pub fn pack_varlen(
    order: &[Pair],
    budget: u64,
    longest: u32,
    batches: &mut Vec<Batch>,
    samples: &mut Vec<u32>,
) {
    let n = order.len();
    let mut pending = Pending::new(n, longest);
    let mut taken = vec![false; n];
    let (mut admitted, mut head, mut in_window) = (0usize, 0usize, 0usize);

    loop {
        let mut open = Batch {
            bucket: 0,
            start: samples.len() as u32,
            count: 0,
            max_len: 0,
            real_tokens: 0,
        };
        loop {
            while in_window < PACK_LOOKAHEAD && admitted < n {
                pending.insert(admitted as u32, order[admitted][1]);
                admitted += 1;
                in_window += 1;
            }
            while head < admitted && taken[head] {
                head += 1;
            }
            if head == admitted {
                break;
            }
            let gap = budget - open.real_tokens;
            let pos = if u64::from(order[head][1]) <= gap {
                head
            } else {
                let limit = gap.min(u64::from(longest)) as usize;
                match pending.largest_le(limit) {
                    Some(len) => pending.head[len as usize] as usize,
                    None => break,
                }
            };
            let [index, len] = order[pos];
            pending.remove(pos as u32, len);
            taken[pos] = true;
            in_window -= 1;
            open.count += 1;
            open.max_len = open.max_len.max(len);
            open.real_tokens += u64::from(len);
            samples.push(index);
        }
        if open.count == 0 {
            break;
        }
        batches.push(open);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(lengths: &[u32]) -> Vec<Pair> {
        lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| [i as u32, len])
            .collect()
    }

    fn pack_padded(order: &[Pair], budget: u64) -> (Vec<Batch>, Vec<u32>) {
        let mut buf: Vec<u32> = order.iter().flatten().copied().collect();
        let mut batches = Vec::new();
        let mut run = PaddedRun::new(budget, 0, 0);
        run.feed(&mut buf, 0, order.len(), &mut batches);
        run.finish(&mut batches);
        buf.truncate(order.len());
        (batches, buf)
    }

    #[test]
    fn in_place_packing_yields_the_indices_in_order() {
        let order = [[7, 5], [3, 9], [9, 1], [0, 4], [2, 2]];
        let (batches, samples) = pack_padded(&order, 18);
        assert_eq!(samples, vec![7, 3, 9, 0, 2]);
        // [5, 9] pads to 18; [1, 4, 2] pads to 12.
        let shape: Vec<(u32, u32, u32, u64)> = batches
            .iter()
            .map(|b| (b.start, b.count, b.max_len, b.real_tokens))
            .collect();
        assert_eq!(shape, vec![(0, 2, 9, 14), (2, 3, 4, 7)]);
    }

    #[test]
    fn pending_finds_largest_fitting() {
        let mut p = Pending::new(10, 9000);
        assert_eq!(p.largest_le(9000), None);
        for (pos, len) in [(0, 5), (1, 17), (2, 17), (3, 60), (4, 8999), (5, 4100)] {
            p.insert(pos, len);
        }
        assert_eq!(p.largest_le(4), None);
        assert_eq!(p.largest_le(5), Some(5));
        assert_eq!(p.largest_le(59), Some(17));
        assert_eq!(p.largest_le(4099), Some(60));
        assert_eq!(p.largest_le(4100), Some(4100));
        assert_eq!(p.largest_le(9000), Some(8999));
        p.remove(1, 17);
        assert_eq!(p.largest_le(20), Some(17));
        assert_eq!(p.head[17], 2);
        p.remove(2, 17);
        assert_eq!(p.largest_le(20), Some(5));
        p.remove(4, 8999);
        p.remove(5, 4100);
        assert_eq!(p.largest_le(9000), Some(60));
    }

    /// Brute force against the bitmap search, over every limit, as samples come and go.
    #[test]
    fn pending_agrees_with_a_scan() {
        let longest = 300;
        let mut p = Pending::new(64, longest);
        let mut present: Vec<Option<u32>> = vec![None; 64];
        let mut x = 12345u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let pos = (x >> 33) as usize % 64;
            match present[pos] {
                Some(len) => {
                    p.remove(pos as u32, len);
                    present[pos] = None;
                }
                None => {
                    let len = 1 + (x >> 45) as u32 % longest;
                    p.insert(pos as u32, len);
                    present[pos] = Some(len);
                }
            }
            for limit in 0..=longest as usize {
                let expect = present
                    .iter()
                    .flatten()
                    .copied()
                    .filter(|&l| l as usize <= limit)
                    .max();
                assert_eq!(p.largest_le(limit), expect, "limit {limit}");
            }
        }
    }

    /// The first seed bug: on unsorted input the batch maximum is the running maximum, not the
    /// length of the sample being added.
    #[test]
    fn padded_packing_tracks_running_maximum_on_unsorted_input() {
        // Budget 2000: [1000, 100] pads to 2000; adding a third sample would pad to 3000. A packer
        // using the newest length (100) as the maximum would accept all four (4 × 100 = 400).
        let (batches, _) = pack_padded(&pairs(&[1000, 100, 100, 100]), 2000);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].count, 2);
        assert_eq!(batches[0].max_len, 1000);
        for b in &batches {
            assert!(u64::from(b.count) * u64::from(b.max_len) <= 2000);
        }
    }

    #[test]
    fn varlen_fills_gaps_from_lookahead() {
        // Budget 100: 60 then 70 does not fit; the packer fills the gap of 40 with the 40.
        let order = pairs(&[60, 70, 30, 40]);
        let mut batches = Vec::new();
        let mut samples = Vec::new();
        pack_varlen(&order, 100, 100, &mut batches, &mut samples);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].real_tokens, 100);
        assert_eq!(&samples[..2], &[0, 3]);
        assert_eq!(batches[1].real_tokens, 100);
    }
}
