-- Throttled heads under concurrency. A head writer (the deferred_key
-- triggers) looks its target up in target_control with its statement's
-- snapshot, so it can miss an operator's change to target_control that
-- commits meanwhile; and target_control's trigger (deferred_key_rethrottle)
-- cannot see heads written by transactions that have not committed yet. Two
-- cases:
--
--   - A target becomes throttled (paused, rate-limited) while a head of it
--     is being written: the head may be left unflagged (throttled = false).
--     That is safe: every claim still checks target_control itself
--     (dispatch_claim.sql), so the head is not sent while it must not be.
--     It costs the main claim a skipped row until the head is written again,
--     the target is un-throttled, or deferred_key_throttle_sweep() (run by
--     maintenance) flags it; a rate-limited target's head left so waits for
--     that sweep, since only flagged heads are claimed under a limit.
--   - A target stops being throttled (resumed, limit removed, row deleted)
--     while a head of it is being written: a head left flagged would never be
--     claimed. That cannot happen: a writer flags a head only while holding a
--     shared advisory lock on its target (deferred_key_throttle_share, which
--     never waits), and reads target_control again with a snapshot taken
--     after that lock; the un-throttling takes the same lock exclusively
--     before it unflags the target's heads, so it waits for the writers that
--     hold it and then sees their heads. A writer that cannot take the lock
--     (an un-throttling is under way) leaves its heads unflagged: the first
--     case.
--
-- deferred_key_throttle_share takes, without waiting, a shared advisory
-- lock (held to the end of the transaction) on each target among targets
-- (NULL: all) that is paused or rate-limited, and returns those it got.
-- Callers ask about the targets they write heads of: since migration 0017
-- none asks for all, since each lock is an entry of the shared lock table
-- and a few thousand throttled targets filled it.
-- Advisory rather than row locks: a share lock on the target_control row
-- would conflict with the dispatchers' token takes, or let a stream of
-- overlapping writers starve an operator's change, whereas the lock manager
-- queues a waiting exclusive request ahead of later shared ones (a try then
-- fails).
--
-- PL/pgSQL on generic plans (migration 0016): PostgreSQL plans a SQL
-- function's statement anew on every call from another statement, and the
-- head triggers and deferred_key_refresh call this once per statement:
-- about 8 µs of planning per message at 5,000 msgs/s, for a read of a
-- table with a row per controlled target. PL/pgSQL keeps a plan, but left
-- to choose it kept custom ones here (a custom plan of the NULL case skips
-- the filter, which makes the generic plan look dearer), so the generic
-- plan is forced; the two cases are two statements so that each has a
-- plan of its own, the second able to use target_control's primary key.

CREATE OR REPLACE FUNCTION deferred_key_throttle_share(targets text[]) RETURNS text[]
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- CASE so that only throttled targets are locked, whatever order the
    -- quals run in.
    IF targets IS NULL THEN
        RETURN (
            SELECT coalesce(array_agg(c.target_topic ORDER BY c.target_topic), '{}')
            FROM target_control c
            WHERE CASE WHEN c.paused OR c.rate_limit IS NOT NULL
                       THEN pg_try_advisory_xact_lock_shared(hashtext('deferred_key.throttled'), hashtext(c.target_topic))
                       ELSE false
                  END
        );
    END IF;
    -- The target test is in the CASE too: a generic plan does not know how
    -- long targets is and may run the CASE before the plain test (seen on
    -- a sequential scan), which would lock throttled targets not asked
    -- about. The plain test is what the primary key's index takes.
    RETURN (
        SELECT coalesce(array_agg(c.target_topic ORDER BY c.target_topic), '{}')
        FROM target_control c
        WHERE c.target_topic = ANY (targets)
          AND CASE WHEN c.target_topic = ANY (targets) AND (c.paused OR c.rate_limit IS NOT NULL)
                   THEN pg_try_advisory_xact_lock_shared(hashtext('deferred_key.throttled'), hashtext(c.target_topic))
                   ELSE false
              END
    );
END
$$;
