"""The gated delta rule: GDN (scalar gate per head) and KDA (per-channel gate) share this core."""
