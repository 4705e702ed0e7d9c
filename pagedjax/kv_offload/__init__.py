"""KV memory below the device, one room (the engine's side; the scheduler keeps the books,
pagedjax.scheduler.host_tier): whole blocks moved device <-> host as compiled programs
(block_transfers: swap preemption and the tiers), the tiered prefix cache's host arrays,
transfers and counters (tiers) and its disk tier (disk_tier: block files, checks, the writer
thread)."""
