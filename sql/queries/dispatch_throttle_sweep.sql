-- Repair deferred_key.throttled flags left stale by a race between an
-- operator's change to target_control and a concurrent head write (see
-- "Throttled heads under concurrency" in migration 0002): a head of a paused
-- or rate-limited target left unflagged costs the main claim a skipped row,
-- and a rate-limited target's head so left is not claimed under its limit
-- until this flags it. Returns how many flags changed. It reads all of
-- deferred_key, which is why periodic maintenance runs it, never a poll. No
-- parameters.
SELECT deferred_key_throttle_sweep() AS changed
