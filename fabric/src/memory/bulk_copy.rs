//! Copying many bytes out of pinned memory at once: a value's bytes for a direct GET
//! ([`super::PinnedMemory::read_append`]). On x86-64 they go 128 bytes per turn through AVX
//! registers where the CPU has AVX and there are 128 or more, else 64 per turn through SSE2
//! registers (four loads and four stores a turn: 11 instructions where eight atomic word
//! loads and stores take about 20 for 64 bytes, and no byte-by-byte head or tail); elsewhere,
//! and below 64 bytes, [`super::PinnedMemory`] copies one atomic word at a time.
//!
//! # Atomicity
//! The copy is not one atomic read, and on x86-64 not one atomic read per word either: the
//! architecture promises an untorn read of an aligned quadword, and a 16-byte SSE load may be
//! made of several accesses. Like a NIC's READ, it may see a concurrent write in part. Its
//! callers check what they copied by other means: a direct GET by the slot word read before
//! and after the block (a block is never written while a slot names it), a list's READ by the
//! block's checksum. A single word that must not tear is read with
//! [`super::PinnedMemory::load_u64`].

/// Bytes one turn of the SSE2 loop copies: the shortest copy [`copy_bytes_out`] makes.
pub(super) const TURN_BYTES: usize = 64;

/// Copies the `length` bytes at `source` to `target`, 128 bytes per turn through AVX registers
/// (from 128 bytes, where the CPU has AVX) or 64 through SSE2 registers, with unaligned loads
/// and stores, the last turn overlapping the one before when `length` is
/// not a multiple of 64 (no byte-by-byte head or tail): `true`. `false`, with nothing copied,
/// where this does not apply (fewer than 64 bytes, or not x86-64); the caller copies word by
/// word.
///
/// # Safety
/// `source` must be valid for reads of `length` bytes for the call (the words of a mapping
/// that other threads and processes may write meanwhile: the module's *Atomicity*), and
/// `target` valid for writes of `length` bytes that do not overlap `source` and that nothing
/// else reads or writes during the call.
pub(super) unsafe fn copy_bytes_out(source: *const u8, length: usize, target: *mut u8) -> bool {
    #[cfg(target_arch = "x86_64")]
    if length >= WIDE_TURN_BYTES && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: as `copy_bytes_out`'s, and the CPU has AVX (checked just above).
        unsafe { copy_wide(source, length, target) };
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if length >= TURN_BYTES {
        let turns = length / TURN_BYTES;
        let last = length - TURN_BYTES;
        // SAFETY: every turn reads and writes 64 bytes at the same offset from `source` and
        // `target`: offsets `64 * i` for `i < turns` (`64 * turns <= length`) and `last`
        // (`last + 64 == length`), all inside the two ranges the caller vouches for. The
        // loads are machine loads of memory that other threads and processes may write
        // meanwhile: made inside `asm!`, they are not Rust accesses and cannot be a data race
        // in Rust's sense; their effect is that of relaxed atomic loads of the bytes, which
        // may see a concurrent write in part (the module's *Atomicity*). The block touches
        // only those two ranges, the named registers and the flags, and no stack. The
        // compiler treats it as reading and writing memory, so no access of the caller moves
        // across it, and x86-64 keeps loads in program order: its loads come after every
        // earlier load (the slot word read before) and before every later one (the slot word
        // read again).
        unsafe {
            std::arch::asm!(
                "2:",
                "movdqu {a}, xmmword ptr [{source} + {at}]",
                "movdqu {b}, xmmword ptr [{source} + {at} + 16]",
                "movdqu {c}, xmmword ptr [{source} + {at} + 32]",
                "movdqu {d}, xmmword ptr [{source} + {at} + 48]",
                "movdqu xmmword ptr [{target} + {at}], {a}",
                "movdqu xmmword ptr [{target} + {at} + 16], {b}",
                "movdqu xmmword ptr [{target} + {at} + 32], {c}",
                "movdqu xmmword ptr [{target} + {at} + 48], {d}",
                "add {at}, 64",
                "dec {turns}",
                "jnz 2b",
                // The last 64 bytes (again, when `length` is a multiple of 64).
                "movdqu {a}, xmmword ptr [{source} + {last}]",
                "movdqu {b}, xmmword ptr [{source} + {last} + 16]",
                "movdqu {c}, xmmword ptr [{source} + {last} + 32]",
                "movdqu {d}, xmmword ptr [{source} + {last} + 48]",
                "movdqu xmmword ptr [{target} + {last}], {a}",
                "movdqu xmmword ptr [{target} + {last} + 16], {b}",
                "movdqu xmmword ptr [{target} + {last} + 32], {c}",
                "movdqu xmmword ptr [{target} + {last} + 48], {d}",
                source = in(reg) source,
                target = in(reg) target,
                last = in(reg) last,
                at = inout(reg) 0usize => _,
                turns = inout(reg) turns => _,
                a = out(xmm_reg) _,
                b = out(xmm_reg) _,
                c = out(xmm_reg) _,
                d = out(xmm_reg) _,
                options(nostack),
            );
        }
        return true;
    }
    let _ = (source, length, target);
    false
}

/// Bytes one turn of the AVX loop copies.
#[cfg(target_arch = "x86_64")]
const WIDE_TURN_BYTES: usize = 128;

/// [`copy_bytes_out`] 128 bytes per turn through AVX registers, for `length` of at least 128
/// on a CPU with AVX.
///
/// # Safety
/// As [`copy_bytes_out`]'s, with `length >= 128`, on a CPU with AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_wide(source: *const u8, length: usize, target: *mut u8) {
    let turns = length / WIDE_TURN_BYTES;
    let last = length - WIDE_TURN_BYTES;
    // SAFETY: as in `copy_bytes_out`, with turns of 128 bytes at `128 * i` for `i < turns`
    // and at `last` (`last + 128 == length`), inside both ranges; the CPU has AVX (the
    // caller's check), and `vzeroupper` leaves the upper halves clear for SSE code after it.
    unsafe {
        std::arch::asm!(
            "2:",
            "vmovdqu {a}, ymmword ptr [{source} + {at}]",
            "vmovdqu {b}, ymmword ptr [{source} + {at} + 32]",
            "vmovdqu {c}, ymmword ptr [{source} + {at} + 64]",
            "vmovdqu {d}, ymmword ptr [{source} + {at} + 96]",
            "vmovdqu ymmword ptr [{target} + {at}], {a}",
            "vmovdqu ymmword ptr [{target} + {at} + 32], {b}",
            "vmovdqu ymmword ptr [{target} + {at} + 64], {c}",
            "vmovdqu ymmword ptr [{target} + {at} + 96], {d}",
            "add {at}, 128",
            "dec {turns}",
            "jnz 2b",
            // The last 128 bytes (again, when `length` is a multiple of 128).
            "vmovdqu {a}, ymmword ptr [{source} + {last}]",
            "vmovdqu {b}, ymmword ptr [{source} + {last} + 32]",
            "vmovdqu {c}, ymmword ptr [{source} + {last} + 64]",
            "vmovdqu {d}, ymmword ptr [{source} + {last} + 96]",
            "vmovdqu ymmword ptr [{target} + {last}], {a}",
            "vmovdqu ymmword ptr [{target} + {last} + 32], {b}",
            "vmovdqu ymmword ptr [{target} + {last} + 64], {c}",
            "vmovdqu ymmword ptr [{target} + {last} + 96], {d}",
            "vzeroupper",
            source = in(reg) source,
            target = in(reg) target,
            last = in(reg) last,
            at = inout(reg) 0usize => _,
            turns = inout(reg) turns => _,
            a = out(ymm_reg) _,
            b = out(ymm_reg) _,
            c = out(ymm_reg) _,
            d = out(ymm_reg) _,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length up to a few turns, at every source and target misalignment: the bytes
    /// copied are the source's, and nothing past them is written; below one turn, nothing is
    /// copied (the caller's word path).
    #[test]
    fn copies_every_byte_and_nothing_more() {
        let source: Vec<u8> = (0..400u32).map(|index| (index * 7 + 3) as u8).collect();
        for length in 0..400 - 8 {
            for (from, to) in [(0, 0), (3, 0), (0, 5), (7, 1), (8, 8)] {
                let mut target = vec![0xAAu8; length + 16];
                // SAFETY: `length` bytes from `from` lie inside `source` and from `to` inside
                // `target`, which nothing else touches.
                let copied = unsafe {
                    copy_bytes_out(
                        source.as_ptr().add(from),
                        length,
                        target.as_mut_ptr().add(to),
                    )
                };
                assert_eq!(copied, cfg!(target_arch = "x86_64") && length >= TURN_BYTES);
                if copied {
                    assert_eq!(&target[to..to + length], &source[from..from + length]);
                } else {
                    assert!(target[to..to + length].iter().all(|byte| *byte == 0xAA));
                }
                assert!(target[..to].iter().all(|byte| *byte == 0xAA));
                assert!(target[to + length..].iter().all(|byte| *byte == 0xAA));
            }
        }
    }
}
