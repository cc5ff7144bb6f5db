-- deferred_key_after_delete: the AFTER DELETE trigger of deferred_message
-- that keeps deferred_key's heads. Deleting a pending message, or a parked
-- one that holds its key, may move or remove its key's head; the keys and
-- unordered ids touched go to deferred_key_refresh.
--
-- plan_cache_mode: PL/pgSQL keeps each statement's plan for the life of the
-- connection, and after a few calls settles on a generic plan made without
-- the actual arrays. A generic plan made while deferred_key was small can
-- join it by a full scan, and keep doing so at a million keys (seen in the
-- benchmark: a finalize taking seconds). Planning each call with the real
-- arguments costs well under a millisecond per statement, once per batch,
-- not per message. (Migration 0002 set it with ALTER FUNCTION; it is part of
-- the definition here, so that re-applying this file keeps it.)

CREATE OR REPLACE FUNCTION deferred_key_after_delete() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    keys text[];
    ids bigint[];
BEGIN
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
