-- deferred_key_after_update: the AFTER UPDATE trigger of deferred_message
-- that keeps deferred_key's heads. Only changes to what defines a head
-- matter (business_key, seq, next_run_at, state, target_topic,
-- park_holds_key); an UPDATE of, say, error_message alone leaves every head
-- as it was. An UPDATE that changes id is delete-plus-insert as far as heads
-- go. The keys and unordered ids touched go to deferred_key_refresh.
--
-- plan_cache_mode: PL/pgSQL keeps each statement's plan for the life of the
-- connection, and after a few calls settles on a generic plan made without
-- the actual arrays. A generic plan made while deferred_key was small can
-- join it by a full scan, and keep doing so at a million keys (seen in the
-- benchmark: a finalize taking seconds). Planning each call with the real
-- arguments costs well under a millisecond per statement, once per batch,
-- not per message. (Migration 0002 set it with ALTER FUNCTION; it is part of
-- the definition here, so that re-applying this file keeps it.)

CREATE OR REPLACE FUNCTION deferred_key_after_update() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    keys text[];
    ids bigint[];
BEGIN
    PERFORM deferred_require_read_committed(TG_TABLE_NAME);
    SELECT array_agg(DISTINCT k ORDER BY k) FILTER (WHERE k IS NOT NULL),
           array_agg(DISTINCT u) FILTER (WHERE u IS NOT NULL)
    INTO keys, ids
    FROM (
        SELECT o.business_key AS k, CASE WHEN o.business_key IS NULL THEN o.id END AS u
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE (o.business_key, o.seq, o.next_run_at, o.state, o.target_topic, o.park_holds_key)
              IS DISTINCT FROM (n.business_key, n.seq, n.next_run_at, n.state, n.target_topic, n.park_holds_key)
        UNION ALL
        SELECT n.business_key, CASE WHEN n.business_key IS NULL THEN n.id END
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE (o.business_key, o.seq, o.next_run_at, o.state, o.target_topic, o.park_holds_key)
              IS DISTINCT FROM (n.business_key, n.seq, n.next_run_at, n.state, n.target_topic, n.park_holds_key)
        UNION ALL
        SELECT o.business_key, CASE WHEN o.business_key IS NULL THEN o.id END
        FROM old_rows o WHERE NOT EXISTS (SELECT 1 FROM new_rows n WHERE n.id = o.id)
        UNION ALL
        SELECT n.business_key, CASE WHEN n.business_key IS NULL THEN n.id END
        FROM new_rows n WHERE NOT EXISTS (SELECT 1 FROM old_rows o WHERE o.id = n.id)
    ) c;
    PERFORM deferred_key_refresh(coalesce(keys, '{}'), coalesce(ids, '{}'));
    RETURN NULL;
END
$$;
