"""A classic-BPF interpreter for seccomp programs, and the kernel's rule for several filters.

It runs the very bytes libseccomp exported (``jaild.runtime.seccomp.bpf_program``) over a
``struct seccomp_data``, as the kernel's interpreter would: every instruction class a
seccomp filter may hold (the kernel's ``seccomp_check_filter`` allows loads of the data's
32-bit words, the scratch memory, ALU, jumps and returns); anything else raises, so a
program this cannot run fails the test rather than passing it.

Several filters: the kernel runs them newest first and keeps the verdict whose action comes
first in precedence, the first met of equal ones (kernel/seccomp.c, ``seccomp_run_filters``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
M32 = 0xFFFFFFFF

_INSN = struct.Struct("<HBBI")


class Program:
    """One exported filter, decoded once."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) % 8 or not raw:
            raise ValueError(f"a BPF program of {len(raw)} bytes")
        self.insns = [_INSN.unpack_from(raw, i) for i in range(0, len(raw), 8)]

    def run(self, data: bytes) -> int:
        """The program's return value for ``data`` (a ``struct seccomp_data``, 64 bytes)."""
        a = x = 0
        mem = [0] * 16
        pc = 0
        insns = self.insns
        while True:
            code, jt, jf, k = insns[pc]
            pc += 1
            cls = code & 0x07
            if cls == 0x00:  # BPF_LD
                mode = code & 0xE0
                if code & 0x18 != 0x00:
                    raise ValueError(f"a load of size {code & 0x18:#x}")
                if mode == 0x20:  # BPF_ABS
                    if k % 4 or k + 4 > len(data):
                        raise ValueError(f"a load at offset {k}")
                    a = int.from_bytes(data[k:k + 4], "little")
                elif mode == 0x00:  # BPF_IMM
                    a = k
                elif mode == 0x60:  # BPF_MEM
                    a = mem[k]
                elif mode == 0x80:  # BPF_LEN
                    a = len(data)
                else:
                    raise ValueError(f"load mode {mode:#x}")
            elif cls == 0x01:  # BPF_LDX
                mode = code & 0xE0
                if mode == 0x00:
                    x = k
                elif mode == 0x60:
                    x = mem[k]
                elif mode == 0x80:
                    x = len(data)
                else:
                    raise ValueError(f"ldx mode {mode:#x}")
            elif cls == 0x02:  # BPF_ST
                mem[k] = a
            elif cls == 0x03:  # BPF_STX
                mem[k] = x
            elif cls == 0x04:  # BPF_ALU
                a = _alu(code & 0xF0, a, x if code & 0x08 else k)
            elif cls == 0x05:  # BPF_JMP
                op = code & 0xF0
                if op == 0x00:  # BPF_JA
                    pc += k
                    continue
                operand = x if code & 0x08 else k
                if op == 0x10:
                    taken = a == operand
                elif op == 0x20:
                    taken = a > operand
                elif op == 0x30:
                    taken = a >= operand
                elif op == 0x40:
                    taken = bool(a & operand)
                else:
                    raise ValueError(f"jump op {op:#x}")
                pc += jt if taken else jf
            elif cls == 0x06:  # BPF_RET
                rval = code & 0x18
                return a if rval == 0x10 else k
            else:  # BPF_MISC
                if code & 0xF8 == 0x00:
                    x = a
                elif code & 0xF8 == 0x80:
                    a = x
                else:
                    raise ValueError(f"misc op {code:#x}")


def _alu(op: int, a: int, operand: int) -> int:
    if op == 0x00:
        return (a + operand) & M32
    if op == 0x10:
        return (a - operand) & M32
    if op == 0x20:
        return (a * operand) & M32
    if op == 0x30:
        return a // operand
    if op == 0x40:
        return a | operand
    if op == 0x50:
        return a & operand
    if op == 0x60:
        return (a << operand) & M32 if operand < 32 else 0
    if op == 0x70:
        return a >> operand if operand < 32 else 0
    if op == 0x80:
        return (-a) & M32
    if op == 0x90:
        return a % operand
    if op == 0xA0:
        return a ^ operand
    raise ValueError(f"alu op {op:#x}")


def seccomp_data(nr: int, arch: int, args: Sequence[int] = (), ip: int = 0) -> bytes:
    """A ``struct seccomp_data`` (little-endian, as on x86_64)."""
    full = [*args, *[0] * (6 - len(args))]
    return struct.pack("<iIQ6Q", nr, arch, ip, *full)


def _action(ret: int) -> int:
    """``ACTION_ONLY``: the action bits, as a signed 32-bit number."""
    v = ret & SECCOMP_RET_ACTION_FULL
    return v - (1 << 32) if v & 0x80000000 else v


def verdict(programs: Sequence[Program], data: bytes) -> int:
    """What the kernel does with ``data`` under ``programs`` loaded in this order."""
    ret = SECCOMP_RET_ALLOW
    for program in reversed(programs):
        cur = program.run(data)
        if _action(cur) < _action(ret):
            ret = cur
    return ret
