"""What prefixkv reads of /proc/cpuinfo on a 64-bit ARM CPU, which names its features and model
otherwise than x86's: the build cache and the kernel choice are keyed by them (build.py), so an
ARM machine's build is keyed apart from another ARM CPU's, as an x86 one's is. (Under qemu-user,
bench/emulated_aarch64.sh, /proc/cpuinfo is the host's: this is checked here instead, with an AWS
Graviton 3's.)"""

from __future__ import annotations

from prefixkv.model.kernels import build

GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc \
dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm \
bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""


def test_an_arm_cpus_features_and_model(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(GRAVITON3)
    monkeypatch.setattr(build, "CPUINFO", cpuinfo)
    monkeypatch.delenv(build.EMULATE_ENV, raising=False)
    assert "sve" in build.cpu_flags().split() and "bf16" in build.cpu_flags().split()
    assert build.cpu_model() == "CPU implementer 0x41, part 0xd40"
    assert not build.arch_runs_here("x86-64-v3")  # refused with a log line, not a SIGILL


def test_no_cpuinfo_reads_as_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "CPUINFO", tmp_path / "missing")
    monkeypatch.delenv(build.EMULATE_ENV, raising=False)
    assert build.cpu_flags() == "" and build.cpu_model() == ""
