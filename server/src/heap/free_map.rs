//! The heap's free extents as a bitmap, one bit per extent, kept beside the extent states
//! (`heap.rs`): a grant is a run of free extents, and finding one by walking every extent's
//! state cost a pass over the whole heap per `AllocateChunk` (half of a node's CPU under
//! YCSB-A, `docs/benchmarks.md`, *Where the node's time goes*). Over the bitmap a search skips
//! 64 taken or 64 free extents per word.

use super::Grant;

/// Bits per word of the map.
const BITS: usize = 64;

/// One bit per extent, set while the extent is free. Bits past the last extent stay clear.
#[derive(Debug, Clone)]
pub(super) struct FreeMap {
    /// The bits, extent `index` at bit `index % 64` of word `index / 64`.
    words: Vec<u64>,
    /// Extents in the heap.
    count: usize,
}

impl FreeMap {
    /// A map of `count` extents, every one free.
    pub(super) fn all_free(count: usize) -> Self {
        let mut words = vec![u64::MAX; count.div_ceil(BITS)];
        if count % BITS != 0 {
            if let Some(last) = words.last_mut() {
                *last = (1u64 << (count % BITS)) - 1;
            }
        }
        Self { words, count }
    }

    /// Marks `extent` free.
    pub(super) fn set_free(&mut self, extent: usize) {
        self.words[extent / BITS] |= 1 << (extent % BITS);
    }

    /// Marks the grant's extents taken.
    pub(super) fn take(&mut self, grant: Grant) {
        let first = grant.first_extent as usize;
        for extent in first..first + grant.extents as usize {
            self.words[extent / BITS] &= !(1 << (extent % BITS));
        }
    }

    /// Whether `extent` is free.
    #[cfg(test)]
    pub(super) fn is_free(&self, extent: usize) -> bool {
        self.words[extent / BITS] & (1 << (extent % BITS)) != 0
    }

    /// The first run of `desired` free extents from `from` on (wrapping once; a run never
    /// spans the wrap), else the longest run of at least `needed` (the first of the longest),
    /// cut to `desired`.
    pub(super) fn find_run(&self, from: usize, needed: u64, desired: u64) -> Option<Grant> {
        let from = if from >= self.count { 0 } else { from };
        let mut search = RunSearch {
            needed: needed.max(1),
            desired: desired.max(needed).max(1),
            best: None,
        };
        for (start, end) in [(from, self.count), (0, from)] {
            if let Some(found) = self.search_range(start, end, &mut search) {
                return Some(found);
            }
        }
        search.best
    }

    /// The bits of word `word_index` that lie in `[start, end)`.
    fn word_within(&self, word_index: usize, start: usize, end: usize) -> u64 {
        let base = word_index * BITS;
        let mut word = self.words[word_index];
        if start > base {
            word &= u64::MAX << (start - base);
        }
        if end < base + BITS {
            word &= (1u64 << (end - base)) - 1;
        }
        word
    }

    /// Walks the runs of `[start, end)` in order, word by word: a run that crosses words is
    /// carried over, and the runs inside a word are looked at only when one is long enough to
    /// matter (scattered single free extents cost a few instructions a word, not a step each).
    fn search_range(&self, start: usize, end: usize, search: &mut RunSearch) -> Option<Grant> {
        if start >= end {
            return None;
        }
        // The run reaching the top of the words so far: its first extent and length.
        let mut carry = (start, 0usize);
        for word_index in start / BITS..=(end - 1) / BITS {
            let base = word_index * BITS;
            let word = self.word_within(word_index, start, end);
            if word == u64::MAX {
                if carry.1 == 0 {
                    carry.0 = base;
                }
                carry.1 += BITS;
                if carry.1 as u64 >= search.desired {
                    return search.offer(carry.0, carry.1);
                }
                continue;
            }
            let low = word.trailing_ones() as usize;
            if carry.1 + low > 0 {
                let first = if carry.1 == 0 { base } else { carry.0 };
                if let Some(found) = search.offer(first, carry.1 + low) {
                    return Some(found);
                }
            }
            let high = word.leading_ones() as usize;
            // The runs strictly inside: the low and high runs cleared (both end at a zero).
            let mut inside = word & !((1u64 << low) - 1);
            if high > 0 {
                inside &= !(u64::MAX << (BITS - high));
            }
            while let Some(position) = search.long_enough(inside) {
                let length = (inside >> position).trailing_ones() as usize;
                if let Some(found) = search.offer(base + position, length) {
                    return Some(found);
                }
                inside &= !(((1u64 << length) - 1) << position);
            }
            carry = (base + BITS - high, high);
        }
        if carry.1 > 0 {
            return search.offer(carry.0, carry.1);
        }
        None
    }
}

/// What a search for a run wants, and the best run it found so far.
#[derive(Debug)]
struct RunSearch {
    /// The shortest run that will do.
    needed: u64,
    /// The run length that ends the search.
    desired: u64,
    /// The longest run of at least `needed` so far (the first of the longest).
    best: Option<Grant>,
}

impl RunSearch {
    /// The shortest run that could still change the outcome: longer than the best so far.
    fn threshold(&self) -> u64 {
        self.best
            .map_or(self.needed, |best| best.extents + 1)
            .max(self.needed)
    }

    /// Takes the run of `length` free extents from `first`, the next in order: returns the
    /// grant when it ends the search, else keeps it if it is the longest so far.
    fn offer(&mut self, first: usize, length: usize) -> Option<Grant> {
        let length = length as u64;
        if length >= self.desired {
            return Some(Grant {
                first_extent: first as u64,
                extents: self.desired,
            });
        }
        if length >= self.threshold() {
            self.best = Some(Grant {
                first_extent: first as u64,
                extents: length,
            });
        }
        None
    }

    /// The first bit of `bits` that starts a run of set bits long enough to matter, if any.
    fn long_enough(&self, bits: u64) -> Option<usize> {
        let threshold = self.threshold();
        if bits == 0 || threshold > BITS as u64 {
            return None;
        }
        // A bit stays set only where `threshold` set bits start.
        let mut starts = bits;
        for _ in 1..threshold {
            starts &= starts >> 1;
            if starts == 0 {
                return None;
            }
        }
        Some(starts.trailing_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search as it was made over the states, extent by extent: the reference.
    fn reference_run(free: &[bool], from: usize, needed: u64, desired: u64) -> Option<Grant> {
        let count = free.len();
        let mut best: Option<Grant> = None;
        let mut run: Option<Grant> = None;
        for step in 0..count {
            let index = (from + step) % count;
            if index == 0 {
                run = None;
            }
            if !free[index] {
                run = None;
                continue;
            }
            let current = run.get_or_insert(Grant {
                first_extent: index as u64,
                extents: 0,
            });
            current.extents += 1;
            if current.extents >= desired {
                return Some(*current);
            }
            if current.extents >= needed && best.is_none_or(|best| current.extents > best.extents) {
                best = Some(*current);
            }
        }
        best
    }

    /// A small deterministic generator (xorshift), so the test needs no dependency.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn the_bitmap_search_finds_what_the_walk_over_the_states_found() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..400 {
            let count = 1 + (next(&mut state) % 300) as usize;
            // Mostly taken, mostly free, or mixed: runs of every length, across word edges.
            let free_share = [10, 50, 90][round % 3];
            let free: Vec<bool> = (0..count)
                .map(|_| next(&mut state) % 100 < free_share)
                .collect();
            let mut map = FreeMap::all_free(count);
            for (extent, is_free) in free.iter().enumerate() {
                if !is_free {
                    map.take(Grant {
                        first_extent: extent as u64,
                        extents: 1,
                    });
                }
            }
            for (extent, is_free) in free.iter().enumerate() {
                assert_eq!(map.is_free(extent), *is_free);
            }
            for _ in 0..20 {
                let from = (next(&mut state) % (count as u64 + 1)) as usize;
                let needed = 1 + next(&mut state) % 8;
                let desired = needed + next(&mut state) % 200;
                assert_eq!(
                    map.find_run(from, needed, desired),
                    reference_run(&free, from % count, needed, desired),
                    "count {count}, from {from}, needed {needed}, desired {desired}"
                );
            }
        }
    }

    #[test]
    fn freed_and_taken_extents_are_seen_by_the_search() {
        let mut map = FreeMap::all_free(130);
        map.take(Grant {
            first_extent: 0,
            extents: 130,
        });
        assert_eq!(map.find_run(0, 1, 4), None);
        for extent in 62..67 {
            map.set_free(extent);
        }
        assert_eq!(
            map.find_run(0, 1, 4),
            Some(Grant {
                first_extent: 62,
                extents: 4
            }),
            "a run across a word edge"
        );
        assert_eq!(
            map.find_run(64, 1, 8),
            Some(Grant {
                first_extent: 64,
                extents: 3
            }),
            "from the middle of a run: the part after `from`, the longer"
        );
        map.set_free(129);
        assert_eq!(
            map.find_run(129, 2, 2),
            Some(Grant {
                first_extent: 62,
                extents: 2
            }),
            "the last extent alone is too short; the search wraps"
        );
    }
}
