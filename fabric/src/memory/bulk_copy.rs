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
        // SAFETY: as `copy_bytes_out`'s, with `length >= 64`.
        unsafe { copy_narrow(source, length, target) };
        return true;
    }
    let _ = (source, length, target);
    false
}

/// [`copy_bytes_out`] 64 bytes per turn through SSE2 registers (every x86-64 CPU has them),
/// for `length` of at least 64.
///
/// # Safety
/// As [`copy_bytes_out`]'s, with `length >= 64`.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_narrow(source: *const u8, length: usize, target: *mut u8) {
    let turns = length / TURN_BYTES;
    let last = length - TURN_BYTES;
    // SAFETY: every turn reads and writes 64 bytes at the same offset from `source` and
    // `target`: offsets `64 * i` for `i < turns` (`64 * turns <= length`) and `last`
    // (`last + 64 == length`), all inside the two ranges the caller vouches for. The loads are
    // machine loads of memory that other threads and processes may write meanwhile: made
    // inside `asm!`, they are not Rust accesses and cannot be a data race in Rust's sense;
    // their effect is that of relaxed loads of each aligned 8-byte word they cover, as
    // `AtomicU64` makes them (on x86-64 such a word lies in one cache line and is read by one
    // access), which may see a concurrent write in part (the module's *Atomicity*). The block
    // touches only those two ranges, the named registers and the flags, and no stack. The
    // compiler treats it as reading and writing memory, so no access of the caller moves
    // across it, and x86-64 keeps loads in program order: its loads come after every earlier
    // load (the slot word read before) and before every later one (the slot word read again).
    // That order is x86-64's, not Rust's memory model's (an acquire load does not keep
    // earlier relaxed loads before it): a port to another architecture would need a
    // `fence(Acquire)` between such a copy and the slot word read again.
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
            "vmovdqu ymm0, ymmword ptr [{source} + rax]",
            "vmovdqu ymm1, ymmword ptr [{source} + rax + 32]",
            "vmovdqu ymm2, ymmword ptr [{source} + rax + 64]",
            "vmovdqu ymm3, ymmword ptr [{source} + rax + 96]",
            "vmovdqu ymmword ptr [{target} + rax], ymm0",
            "vmovdqu ymmword ptr [{target} + rax + 32], ymm1",
            "vmovdqu ymmword ptr [{target} + rax + 64], ymm2",
            "vmovdqu ymmword ptr [{target} + rax + 96], ymm3",
            "add rax, 128",
            "dec rcx",
            "jnz 2b",
            // The last 128 bytes (again, when `length` is a multiple of 128).
            "vmovdqu ymm0, ymmword ptr [{source} + {last}]",
            "vmovdqu ymm1, ymmword ptr [{source} + {last} + 32]",
            "vmovdqu ymm2, ymmword ptr [{source} + {last} + 64]",
            "vmovdqu ymm3, ymmword ptr [{source} + {last} + 96]",
            "vmovdqu ymmword ptr [{target} + {last}], ymm0",
            "vmovdqu ymmword ptr [{target} + {last} + 32], ymm1",
            "vmovdqu ymmword ptr [{target} + {last} + 64], ymm2",
            "vmovdqu ymmword ptr [{target} + {last} + 96], ymm3",
            "vzeroupper",
            source = in(reg) source,
            target = in(reg) target,
            last = in(reg) last,
            inout("rax") 0usize => _,
            inout("rcx") turns => _,
            // ymm0-ymm3 hold the bytes, and `vzeroupper` clears the upper halves of every
            // vector register: all of them are caller-saved in the C ABI, so this declares
            // them changed at no cost.
            clobber_abi("C"),
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source bytes, and the alignments tried: `(source offset, target offset)`.
    fn source() -> Vec<u8> {
        (0..400u32).map(|index| (index * 7 + 3) as u8).collect()
    }
    const ALIGNMENTS: [(usize, usize); 5] = [(0, 0), (3, 0), (0, 5), (7, 1), (8, 8)];

    /// Runs `copy` for `length` bytes at every alignment: the bytes copied are the source's,
    /// and nothing around them is written.
    fn check_copies(length: usize, copy: impl Fn(*const u8, usize, *mut u8)) {
        let source = source();
        for (from, to) in ALIGNMENTS {
            let mut target = vec![0xAAu8; length + 16];
            // `length` bytes from `from` lie inside `source`, from `to` inside `target`.
            copy(source[from..].as_ptr(), length, target[to..].as_mut_ptr());
            assert_eq!(
                &target[to..to + length],
                &source[from..from + length],
                "{length}"
            );
            assert!(target[..to].iter().all(|byte| *byte == 0xAA));
            assert!(target[to + length..].iter().all(|byte| *byte == 0xAA));
        }
    }

    /// Below one turn nothing is copied (the caller's word path); from one turn on, every
    /// length is, by whichever loop this CPU takes.
    #[test]
    fn copies_every_byte_and_nothing_more() {
        let source = source();
        for length in 0..400 - 8 {
            let mut target = vec![0xAAu8; length + 16];
            // SAFETY: `length` bytes lie inside both vectors, which nothing else touches.
            let copied = unsafe { copy_bytes_out(source.as_ptr(), length, target.as_mut_ptr()) };
            assert_eq!(copied, cfg!(target_arch = "x86_64") && length >= TURN_BYTES);
            if copied {
                check_copies(length, |from, length, to| {
                    // SAFETY: as above (`check_copies` keeps inside both vectors).
                    assert!(unsafe { copy_bytes_out(from, length, to) });
                });
            } else {
                assert!(target.iter().all(|byte| *byte == 0xAA));
            }
        }
    }

    /// Each loop on its own over every length it takes (an AVX CPU never runs the SSE2 loop
    /// past 127 bytes through `copy_bytes_out`, and a CPU without AVX never runs the AVX one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn each_loop_copies_every_length_it_takes() {
        for length in TURN_BYTES..400 - 8 {
            check_copies(length, |from, length, to| {
                // SAFETY: `check_copies` keeps inside both vectors; `length >= 64`.
                unsafe { copy_narrow(from, length, to) }
            });
        }
        if std::arch::is_x86_feature_detected!("avx") {
            for length in WIDE_TURN_BYTES..400 - 8 {
                check_copies(length, |from, length, to| {
                    // SAFETY: as above, `length >= 128`, and the CPU has AVX.
                    unsafe { copy_wide(from, length, to) }
                });
            }
        }
    }
}
