-- deferred_key_after_delete: the AFTER DELETE trigger of deferred_message
-- that keeps deferred_key's heads. Deleting a pending message, or a parked
-- one that holds its key, may move or remove its key's head; the keys and
-- unordered ids touched go to deferred_key_refresh.
--
-- plan_cache_mode = auto (migration 0016; force_custom_plan before): its
-- statements read only the transition table and call deferred_key_refresh,
-- which plans its own statements (auto since migration 0015), so a generic
-- plan costs what a custom one does whatever the statistics say; planned on
-- every call, it spent about 1 µs per message planning at a moderate load
-- (docs/benchmarks.md, "Generic plans for the head triggers").

CREATE OR REPLACE FUNCTION deferred_key_after_delete() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $$
DECLARE
    keys text[];
    ids bigint[];
BEGIN
    PERFORM deferred_require_read_committed(TG_TABLE_NAME);
    SELECT array_agg(DISTINCT business_key ORDER BY business_key)
               FILTER (WHERE business_key IS NOT NULL),
           array_agg(id) FILTER (WHERE business_key IS NULL AND state = 'pending')
    INTO keys, ids
    FROM old_rows
    WHERE state = 'pending' OR (state = 'parked' AND park_holds_key);
    PERFORM deferred_key_refresh(coalesce(keys, '{}'), coalesce(ids, '{}'));
    RETURN NULL;
END
$$;
