-- Release leases that expired, so that what an operator sees in leased_by is
-- true. Claiming does not need this (an expired lease is free to take); this
-- is housekeeping after a dispatcher died. It scans deferred_key, which is why
-- it runs from periodic maintenance and never per poll: a lease can outlive a
-- head change to a message that is not due, or to a parked message that now
-- holds the key (next_run_at 'infinity'), so no index range covers them all.
-- No parameters.
UPDATE deferred_key
SET leased_until = NULL, leased_by = NULL
WHERE leased_until <= now() - interval '1 second'
