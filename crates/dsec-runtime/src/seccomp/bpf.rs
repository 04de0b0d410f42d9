//! Classic BPF for the seccomp filter: a small interpreter of the instructions seccompiler
//! emits, and a binary-search dispatch over syscall numbers.
//!
//! seccompiler compiles a policy into one comparison per syscall, in a row: Docker's
//! profile becomes ~1,600 instructions. The kernel converts and JIT-compiles every
//! instruction of a filter each time a process installs it, and at install it also runs
//! the filter once per syscall number to cache the verdicts that do not depend on
//! arguments: on a 2-core host that took ~1 ms per install, paid by every sandbox's init and
//! by every fncall call. The syscalls the profile allows whatever their arguments are
//! therefore go first, found by a binary search over their ranges (a few dozen
//! instructions), and only the argument-checked rest is left to seccompiler's program.
//! Which numbers those are is read off seccompiler's own program of the whole policy with
//! [`constant_verdict`], so the policy is still written once and compiled by seccompiler.

use seccompiler::sock_filter;

// BPF opcodes are 16-bit and seccomp_data's offsets are below 64: all constants.
#[allow(clippy::cast_possible_truncation)]
pub(super) mod op {
    pub const LD_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    pub const AND: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
    pub const JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
    pub const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    pub const JGT: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
    pub const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    pub const JSET: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
    pub const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    pub const NR_OFFSET: u32 = std::mem::offset_of!(libc::seccomp_data, nr) as u32;
    pub const ARCH_OFFSET: u32 = std::mem::offset_of!(libc::seccomp_data, arch) as u32;
    pub const ARGS_OFFSET: u32 = std::mem::offset_of!(libc::seccomp_data, args) as u32;
}

/// One instruction.
pub(super) fn insn(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// What a syscall carries into the filter; `args: None` while they are not known.
#[derive(Clone, Copy, Debug)]
pub(super) struct Call<'a> {
    pub arch: u32,
    pub nr: u32,
    pub args: Option<&'a [u64; 6]>,
}

/// Runs `program` on `call`: the value it returns, or `None` when it reads something
/// `call` does not know (an argument, the instruction pointer).
///
/// Only what seccompiler and [`dispatch`] emit is understood; anything else is an error,
/// so an analysis never guesses.
pub(super) fn run(program: &[sock_filter], call: Call<'_>) -> Result<Option<u32>, &'static str> {
    let mut acc: u32 = 0;
    let mut pc = 0usize;
    loop {
        let i = program.get(pc).ok_or("a jump leaves the program")?;
        pc += 1;
        let taken = |cond: bool| usize::from(if cond { i.jt } else { i.jf });
        match i.code {
            op::LD_ABS => {
                acc = match i.k {
                    op::NR_OFFSET => call.nr,
                    op::ARCH_OFFSET => call.arch,
                    k if (op::ARGS_OFFSET..op::ARGS_OFFSET + 48).contains(&k) && k % 4 == 0 => {
                        let Some(args) = call.args else {
                            return Ok(None);
                        };
                        let word = usize::try_from((k - op::ARGS_OFFSET) / 4).expect("< 12");
                        let arg = args[word / 2];
                        // seccomp_data is in the CPU's byte order: the low word comes first
                        // on a little-endian machine.
                        let high = (word % 2 == 1) == cfg!(target_endian = "little");
                        #[allow(clippy::cast_possible_truncation)] // one 32-bit half, as meant
                        let half = if high { (arg >> 32) as u32 } else { arg as u32 };
                        half
                    }
                    _ => return Ok(None),
                }
            }
            op::AND => acc &= i.k,
            op::JA => pc += usize::try_from(i.k).map_err(|_| "jump too far")?,
            op::JEQ => pc += taken(acc == i.k),
            op::JGT => pc += taken(acc > i.k),
            op::JGE => pc += taken(acc >= i.k),
            op::JSET => pc += taken(acc & i.k != 0),
            op::RET => return Ok(Some(i.k)),
            _ => return Err("an instruction this interpreter does not know"),
        }
    }
}

/// What `program` answers for syscall `nr` of `arch` whatever the arguments: `None` when
/// the answer depends on them.
pub(super) fn constant_verdict(
    program: &[sock_filter],
    arch: u32,
    nr: u32,
) -> Result<Option<u32>, &'static str> {
    run(
        program,
        Call {
            arch,
            nr,
            args: None,
        },
    )
}

/// Instructions that return `allow` for a syscall number (already in the accumulator) in
/// one of `ranges` (sorted, disjoint, inclusive) and otherwise jump `exit` instructions past
/// their own end. A binary search: about 6 instructions a range, 4 + 2·log₂(ranges) run.
pub(super) fn dispatch(ranges: &[(u32, u32)], allow: u32, exit: u32) -> Vec<sock_filter> {
    let mut out = Vec::new();
    let mut exits = Vec::new();
    emit(ranges, allow, &mut out, &mut exits);
    let end = out.len();
    for at in exits {
        let past = u32::try_from(end - at - 1).expect("a filter is short");
        out[at].k = past + exit;
    }
    out
}

fn emit(ranges: &[(u32, u32)], allow: u32, out: &mut Vec<sock_filter>, exits: &mut Vec<usize>) {
    match ranges {
        [] => {
            exits.push(out.len());
            out.push(insn(op::JA, 0, 0, 0));
        }
        [(lo, hi)] => {
            out.push(insn(op::JGE, *lo, 0, 2)); // below: exit
            out.push(insn(op::JGT, *hi, 1, 0)); // above: exit
            out.push(insn(op::RET, allow, 0, 0));
            exits.push(out.len());
            out.push(insn(op::JA, 0, 0, 0));
        }
        _ => {
            let (left, right) = ranges.split_at(ranges.len() / 2);
            out.push(insn(op::JGE, right[0].0, 0, 1)); // the lower half: skip the next
            let to_right = out.len();
            out.push(insn(op::JA, 0, 0, 0));
            emit(left, allow, out, exits);
            out[to_right].k = u32::try_from(out.len() - to_right - 1).expect("a filter is short");
            emit(right, allow, out, exits);
        }
    }
}

/// Sorted numbers as inclusive ranges of consecutive ones.
pub(super) fn ranges(numbers: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for n in numbers {
        match out.last_mut() {
            Some((_, hi)) if hi.checked_add(1) == Some(n) => *hi = n,
            _ => out.push((n, n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const EXITED: u32 = 7;

    /// `dispatch` followed by a return of `EXITED` where it exits.
    fn dispatcher(ranges: &[(u32, u32)]) -> Vec<sock_filter> {
        let mut p = vec![insn(op::LD_ABS, op::NR_OFFSET, 0, 0)];
        p.extend(dispatch(ranges, ALLOW, 1));
        p.push(insn(op::RET, 0, 0, 0)); // skipped by `exit = 1`
        p.push(insn(op::RET, EXITED, 0, 0));
        p
    }

    #[test]
    fn dispatch_allows_exactly_the_ranges() {
        let numbers: Vec<u32> = (0..500).filter(|n| n % 7 != 0 && n % 11 != 3).collect();
        for set in [vec![], vec![5], numbers.clone()] {
            let program = dispatcher(&ranges(set.iter().copied()));
            for nr in 0..520 {
                let call = Call {
                    arch: 0,
                    nr,
                    args: None,
                };
                let want = if set.contains(&nr) { ALLOW } else { EXITED };
                assert_eq!(run(&program, call), Ok(Some(want)), "nr {nr}");
            }
        }
    }

    #[test]
    fn ranges_join_consecutive_numbers() {
        assert_eq!(ranges([1, 2, 3, 5, 7, 8]), [(1, 3), (5, 5), (7, 8)]);
        assert_eq!(ranges([u32::MAX]), [(u32::MAX, u32::MAX)]);
    }

    #[test]
    fn an_argument_is_unknown_until_given() {
        let program = [
            insn(op::LD_ABS, op::ARGS_OFFSET, 0, 0),
            insn(op::JEQ, 40, 0, 1),
            insn(op::RET, 1, 0, 0),
            insn(op::RET, 2, 0, 0),
        ];
        let mut call = Call {
            arch: 0,
            nr: 0,
            args: None,
        };
        assert_eq!(run(&program, call), Ok(None));
        call.args = Some(&[40, 0, 0, 0, 0, 0]);
        assert_eq!(run(&program, call), Ok(Some(1)));
        call.args = Some(&[40 | 1 << 32, 0, 0, 0, 0, 0]);
        assert_eq!(run(&program, call), Ok(Some(1)), "the low half only");
    }
}
