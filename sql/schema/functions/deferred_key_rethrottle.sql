-- deferred_key_rethrottle sets deferred_key.throttled of every head (not
-- held) of target to whether target is paused or rate-limited now. Run for
-- each target an operator's change to target_control affects; it sees that
-- change, being in the same transaction. Un-throttling first takes the
-- target's advisory lock exclusively (see deferred_key_throttle_share): it
-- waits for the head writers that flagged heads of the target under the old
-- setting, and is then sure to see their heads.
--
-- Rows are locked in key order first, as finalize and the head triggers lock
-- them, so that this cannot deadlock with them; then flagged, by a second
-- statement that sees the rows it locked. Finding the heads of a target that
-- is becoming throttled reads all of deferred_key (the unflagged heads are
-- not indexed by target): acceptable for an operator's pause or limit, not
-- for anything per poll.

CREATE OR REPLACE FUNCTION deferred_key_rethrottle(target text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM target_control c
               WHERE c.target_topic = target AND (c.paused OR c.rate_limit IS NOT NULL)) THEN
        PERFORM FROM deferred_key
        WHERE NOT throttled AND NOT held AND head_target = target
        ORDER BY business_key, head_id
        FOR NO KEY UPDATE;
        UPDATE deferred_key SET throttled = true WHERE NOT throttled AND NOT held AND head_target = target;
    ELSE
        PERFORM pg_advisory_xact_lock(hashtext('deferred_key.throttled'), hashtext(target));
        PERFORM FROM deferred_key
        WHERE throttled AND head_target = target
        ORDER BY business_key, head_id
        FOR NO KEY UPDATE;
        UPDATE deferred_key SET throttled = false WHERE throttled AND head_target = target;
    END IF;
END
$$;
