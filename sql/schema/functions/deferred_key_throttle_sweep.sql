-- deferred_key_throttle_sweep repairs throttled flags left stale (see
-- "Throttled heads under concurrency" in deferred_key_throttle_share.sql),
-- returning how many it changed. It flags heads only as a head writer does
-- (shared lock, then a fresh read), so it cannot race an un-throttling into
-- a stale flag. Maintenance runs it (sql/dispatch_throttle_sweep.sql); it
-- reads all of deferred_key.

CREATE OR REPLACE FUNCTION deferred_key_throttle_sweep() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    throttling text[];
    flagged bigint;
    unflagged bigint;
BEGIN
    -- Only the targets that have heads to flag are locked (migration 0017),
    -- usually none: a lock per throttled target, some thousands of them,
    -- filled the lock table. One probe of deferred_key_target_due per
    -- throttled target finds them.
    throttling := deferred_key_throttle_share(ARRAY(
        SELECT c.target_topic FROM target_control c
        WHERE (c.paused OR c.rate_limit IS NOT NULL)
          AND EXISTS (SELECT 1 FROM deferred_key k
                      WHERE NOT k.throttled AND k.head_target = c.target_topic AND NOT k.held)));
    UPDATE deferred_key k SET throttled = true
    WHERE NOT k.throttled AND NOT k.held AND k.head_target = ANY (throttling)
      AND EXISTS (SELECT 1 FROM target_control c
                  WHERE c.target_topic = k.head_target AND (c.paused OR c.rate_limit IS NOT NULL));
    GET DIAGNOSTICS flagged = ROW_COUNT;
    -- Unflagging is always safe (claims check target_control anyway).
    UPDATE deferred_key k SET throttled = false
    WHERE k.throttled
      AND (k.held OR NOT EXISTS (SELECT 1 FROM target_control c
                                 WHERE c.target_topic = k.head_target AND (c.paused OR c.rate_limit IS NOT NULL)));
    GET DIAGNOSTICS unflagged = ROW_COUNT;
    RETURN flagged + unflagged;
END
$$;
