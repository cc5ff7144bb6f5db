-- Release leases that expired, so that what an operator sees in leased_by is
-- true. Claiming does not need this (an expired lease is free to take); this
-- is housekeeping after a dispatcher died. It scans deferred_key, which is why
-- it runs from periodic maintenance and never per poll: a lease can outlive a
-- head change to a message that is not due, or to a parked message that now
-- holds the key (next_run_at 'infinity'), so no index range covers them all.
-- An emptied row (head_id 0: its last message went while it was leased, see
-- dispatch_release_empty.sql) whose lease expired is deleted: its holder died
-- before releasing it. No parameters; returns the leases released.
WITH emptied AS (
    DELETE FROM deferred_key
    WHERE head_id = 0 AND leased_until <= now() - interval '1 second'
)
UPDATE deferred_key
SET leased_until = NULL, leased_by = NULL
WHERE leased_until <= now() - interval '1 second' AND head_id <> 0
