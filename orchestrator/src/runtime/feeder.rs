//! The feeder: gathers each planned batch's tokens and loss masks (from the store, or synthetic),
//! writes them into the input slot the dispatcher chose, with their checksum, and publishes the
//! slot under its new generation.

use dflash_common::ring::Layout;

use super::Run;
use crate::planner::Layout as PlanLayout;
use crate::store::Store;

/// Where batch tokens come from.
pub(super) enum Tokens {
    Store(Box<Store>),
    /// Synthetic token ids below `vocab`, a pure function of (seed, sample, position).
    Synthetic {
        seed: u64,
        vocab: u32,
    },
}

pub(super) const SYNTHETIC_VOCAB: u32 = 151_936;

impl Tokens {
    /// Appends the first `len` tokens of sample `index` and their loss masks.
    fn sample(&self, index: u32, len: u32, out: &mut Vec<u32>, masks: &mut Vec<u8>) {
        match self {
            Tokens::Store(store) => {
                out.extend_from_slice(&store.tokens(index as usize)[..len as usize]);
                masks.extend_from_slice(&store.loss_mask(index as usize)[..len as usize]);
            }
            Tokens::Synthetic { seed, vocab } => {
                out.extend((0..len).map(|p| {
                    let mut x = seed ^ (u64::from(index) << 32 | u64::from(p));
                    x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
                    x = (x ^ (x >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
                    ((x ^ (x >> 33)) % u64::from(*vocab)) as u32
                }));
                masks.extend(std::iter::repeat_n(1u8, len as usize));
            }
        }
    }
}

impl Run {
    /// Fills free input slots with the next batches of the plan, those before `limit`.
    pub(super) fn feed(&mut self, limit: usize) {
        while let Some((b, slot, generation)) = self.dispatch.feed_below(limit) {
            self.write_batch(b, slot, generation);
        }
    }

    /// The tokens, loss masks and sample lengths of batch `b` of the current epoch.
    fn gather(&self, b: usize, tokens: &mut Vec<u32>, masks: &mut Vec<u8>) -> Vec<u32> {
        let batch = self.plan.batches[b];
        tokens.clear();
        masks.clear();
        let mut lengths = Vec::with_capacity(batch.count as usize);
        for &s in self.plan.batch_samples(&batch) {
            let len = self.planner.lengths()[s as usize];
            self.tokens.sample(s, len, tokens, masks);
            lengths.push(len);
        }
        lengths
    }

    pub(super) fn batch_checksum(&mut self, b: usize) -> u32 {
        let mut tokens = std::mem::take(&mut self.scratch);
        let lengths = self.gather(b, &mut tokens, &mut Vec::new());
        drop(lengths);
        let sum = dflash_common::ring::token_checksum(&tokens);
        self.scratch = tokens;
        sum
    }

    fn write_batch(&mut self, b: usize, slot: u32, generation: u64) {
        let batch = self.plan.batches[b];
        let mut tokens = std::mem::take(&mut self.scratch);
        let mut masks = Vec::with_capacity(tokens.capacity());
        let lengths = self.gather(b, &mut tokens, &mut masks);
        let layout = match self.plan.layout {
            PlanLayout::Packed => Layout::Packed,
            PlanLayout::Padded => Layout::Padded,
        };
        let meta = dflash_common::ring::write_batch(
            self.input.data_mut(slot),
            layout,
            &lengths,
            &tokens,
            &masks,
            batch.max_len,
            self.config.planner.token_budget,
        );
        self.input.publish(slot, generation, meta);
        self.checksums[b] = meta.checksum;
        self.scratch = tokens;
    }
}
