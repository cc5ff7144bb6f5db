-- Release leases that expired, so that what an operator sees in leased_by is
-- true. Claiming does not need this (an expired lease is free to take); this
-- is housekeeping after a dispatcher died. Leased heads are due heads, so the
-- next_run_at bound keeps this on the index range of due heads.
UPDATE deferred_key
SET leased_until = NULL, leased_by = NULL
WHERE next_run_at <= now() AND leased_until <= now() - interval '1 second'
