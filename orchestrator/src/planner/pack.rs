//! Packing samples into batches under a token budget.
//!
//! Padded batches track the *running* maximum length of the open batch, so the budget holds for
//! samples in any order (the original packer assumed sorted input and took the newest sample's
//! length as the batch maximum). Packed (variable-length) batches fill the budget with real tokens:
//! samples are taken in their random order and the last gap of each batch is filled best-fit from a
//! bounded look-ahead, so efficiency comes from filling, not from sorting by length.

use super::Batch;

/// How many upcoming samples the varlen packer may choose from when filling a batch's last gap.
pub const PACK_LOOKAHEAD: usize = 512;

/// Kept samples (length > 0) in ascending (length, index) order: a counting sort, O(n + longest).
pub fn length_order(lengths: &[u32], longest: u32) -> Vec<u32> {
    let mut starts = vec![0usize; longest as usize + 2];
    for &len in lengths {
        if len > 0 {
            starts[len as usize + 1] += 1;
        }
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut order = vec![0u32; starts[starts.len() - 1]];
    for (i, &len) in lengths.iter().enumerate() {
        if len > 0 {
            let slot = &mut starts[len as usize];
            order[*slot] = i as u32;
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

/// Greedy padded packing of `order`, in order ([`PaddedPacker`]). Appends batches (labelled
/// `bucket`) and their samples to the outputs.
pub fn pack_padded(
    order: &[u32],
    lengths: &[u32],
    budget: u64,
    bucket: u16,
    batches: &mut Vec<Batch>,
    samples: &mut Vec<u32>,
) {
    let mut packer = PaddedPacker::new(budget);
    let mut start = samples.len();
    let mut real = 0u64;
    for &idx in order {
        let len = lengths[idx as usize];
        if let Some((count, max_len)) = packer.push(len) {
            batches.push(Batch {
                bucket,
                start: start as u32,
                count,
                max_len,
                real_tokens: real,
            });
            start = samples.len();
            real = 0;
        }
        real += u64::from(len);
        samples.push(idx);
    }
    let (count, max_len) = packer.open();
    if count > 0 {
        batches.push(Batch {
            bucket,
            start: start as u32,
            count,
            max_len,
            real_tokens: real,
        });
    }
}

/// Counts of pending samples per length, with "largest length <= x that has a sample" in O(log n).
struct LengthIndex {
    tree: Vec<u32>,
    log: usize,
}

impl LengthIndex {
    fn new(max_len: u32) -> Self {
        let n = max_len as usize + 1;
        Self {
            tree: vec![0; n + 1],
            log: usize::BITS as usize - n.leading_zeros() as usize,
        }
    }

    fn add(&mut self, len: u32, delta: i32) {
        let mut i = len as usize;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    fn count_le(&self, len: u32) -> u32 {
        let mut i = (len as usize).min(self.tree.len() - 1);
        let mut sum = 0;
        while i > 0 {
            sum += self.tree[i];
            i &= i - 1;
        }
        sum
    }

    /// The smallest length whose prefix count reaches `k` (k >= 1 and <= total).
    fn kth(&self, k: u32) -> u32 {
        let mut pos = 0usize;
        let mut remaining = k;
        for step in (0..=self.log).rev() {
            let next = pos + (1 << step);
            if next < self.tree.len() && self.tree[next] < remaining {
                pos = next;
                remaining -= self.tree[next];
            }
        }
        (pos + 1) as u32
    }

    fn largest_le(&self, len: u32) -> Option<u32> {
        match self.count_le(len) {
            0 => None,
            k => Some(self.kth(k)),
        }
    }
}

/// Variable-length packing: real tokens per batch <= `budget`. Samples enter a look-ahead window of
/// [`PACK_LOOKAHEAD`] in `order`; each batch takes the oldest pending sample while it fits, then
/// fills the remaining gap with the largest pending sample that fits, until none does. `longest`
/// bounds the lengths in `order`.
pub fn pack_varlen(
    order: &[u32],
    lengths: &[u32],
    budget: u64,
    longest: u32,
    batches: &mut Vec<Batch>,
    samples: &mut Vec<u32>,
) {
    let n = order.len();
    let mut index = LengthIndex::new(longest);
    // Pending stream positions by length (stale entries are skipped lazily through `taken`).
    let mut by_length: Vec<Vec<u32>> = vec![Vec::new(); longest as usize + 1];
    let mut taken = vec![false; n];
    let (mut admitted, mut head, mut pending) = (0usize, 0usize, 0usize);

    loop {
        let mut open = Batch {
            bucket: 0,
            start: samples.len() as u32,
            count: 0,
            max_len: 0,
            real_tokens: 0,
        };
        loop {
            while pending < PACK_LOOKAHEAD && admitted < n {
                let len = lengths[order[admitted] as usize];
                index.add(len, 1);
                by_length[len as usize].push(admitted as u32);
                admitted += 1;
                pending += 1;
            }
            while head < admitted && taken[head] {
                head += 1;
            }
            if head == admitted {
                break;
            }
            let gap = budget - open.real_tokens;
            let head_len = lengths[order[head] as usize];
            let pos = if u64::from(head_len) <= gap {
                head
            } else {
                let Some(len) = index.largest_le(gap.min(u64::from(longest)) as u32) else {
                    break;
                };
                let stack = &mut by_length[len as usize];
                loop {
                    let p = stack
                        .pop()
                        .expect("index counts a pending sample of this length")
                        as usize;
                    if !taken[p] {
                        break p;
                    }
                }
            };
            taken[pos] = true;
            pending -= 1;
            let idx = order[pos];
            let len = lengths[idx as usize];
            index.add(len, -1);
            open.count += 1;
            open.max_len = open.max_len.max(len);
            open.real_tokens += u64::from(len);
            samples.push(idx);
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

    #[test]
    fn length_index_finds_largest_fitting() {
        let mut ix = LengthIndex::new(100);
        assert_eq!(ix.largest_le(100), None);
        for len in [5, 17, 17, 60, 100] {
            ix.add(len, 1);
        }
        assert_eq!(ix.largest_le(4), None);
        assert_eq!(ix.largest_le(5), Some(5));
        assert_eq!(ix.largest_le(59), Some(17));
        assert_eq!(ix.largest_le(99), Some(60));
        assert_eq!(ix.largest_le(1000), Some(100));
        ix.add(17, -1);
        assert_eq!(ix.largest_le(20), Some(17));
        ix.add(17, -1);
        assert_eq!(ix.largest_le(20), Some(5));
    }

    /// The first seed bug: on unsorted input the batch maximum is the running maximum, not the
    /// length of the sample being added.
    #[test]
    fn padded_packing_tracks_running_maximum_on_unsorted_input() {
        let lengths = [1000, 100, 100, 100];
        let mut batches = Vec::new();
        let mut samples = Vec::new();
        // Budget 2000: [1000, 100] pads to 2000; adding a third sample would pad to 3000. A packer
        // using the newest length (100) as the maximum would accept all four (4 × 100 = 400).
        pack_padded(&[0, 1, 2, 3], &lengths, 2000, 0, &mut batches, &mut samples);
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
        let lengths = [60, 70, 30, 40];
        let mut batches = Vec::new();
        let mut samples = Vec::new();
        pack_varlen(
            &[0, 1, 2, 3],
            &lengths,
            100,
            100,
            &mut batches,
            &mut samples,
        );
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].real_tokens, 100);
        assert_eq!(&samples[..2], &[0, 3]);
        assert_eq!(batches[1].real_tokens, 100);
    }
}
