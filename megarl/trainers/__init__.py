"""Trainers: the step loop every stage shares, the session, and the SFT / reward-model stages."""
