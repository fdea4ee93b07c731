"""Where hicache's threads may run, and which CPUs a device's interrupts land on."""

from __future__ import annotations

from pathlib import Path

from hicache.threads import irq_cpus

INTERRUPTS = """\
            CPU0       CPU1       CPU2       CPU3
  29:          0          0         11          0  PCI-MSIX-0000:00:05.0   1-edge      virtio4-input
  42:          0          0          0       9120  PCI-MSIX-0000:00:06.0   0-edge      nvidia
  43:          0          0          0          0  PCI-MSIX-0000:00:06.0   1-edge      NVIDIA
  44:          0          0          0          0  PCI-MSIX-0000:00:06.0   2-edge      nvidia
 NMI:          0          0          0          0   Non-maskable interrupts
"""


def fake_proc(root: Path, affinity: dict[int, dict[str, str]]) -> Path:
    (root / "interrupts").write_text(INTERRUPTS)
    for irq, files in affinity.items():
        (root / "irq" / str(irq)).mkdir(parents=True)
        for name, text in files.items():
            (root / "irq" / str(irq) / name).write_text(text)
    return root


def test_the_cpus_of_a_devices_interrupts_come_from_their_effective_affinity(tmp_path):
    proc = fake_proc(
        tmp_path,
        {
            29: {"effective_affinity_list": "2\n"},  # virtio: not the device asked for
            42: {"effective_affinity_list": "3\n", "smp_affinity_list": "0-3\n"},
            43: {"smp_affinity_list": "0-1\n"},  # no effective affinity: the allowed CPUs
            44: {"effective_affinity_list": "garbage\n", "smp_affinity_list": "2\n"},
        },
    )
    assert irq_cpus("nvidia", proc) == {0, 1, 2, 3}
    assert irq_cpus("virtio", proc) == {2}
    assert irq_cpus("mlx5", proc) == frozenset()


def test_no_proc_means_no_cpus(tmp_path):
    assert irq_cpus("nvidia", tmp_path / "missing") == frozenset()
