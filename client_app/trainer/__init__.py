"""Trainer backends behind one interface (`base.Trainer`)."""
