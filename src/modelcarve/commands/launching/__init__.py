"""The launching process's side of run / verify / generate / serve: checks before any rank starts, rendezvous flags, the per-rank worker entry, checkpoint and dry-run flags."""
