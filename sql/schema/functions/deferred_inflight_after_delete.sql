-- deferred_inflight_after_delete: a key leaves flight when its last
-- deferred_inflight row goes (the group committed past its record, or an
-- operator released it), and its head may be claimed again.
--
-- While a key has in-flight rows, its deferred_key row carries the lease
-- 'in-flight' until 'infinity' (dispatch_delete.sql sets it): no dispatcher
-- claims it, however due its head, because a record of the key the
-- consumer has not handled yet may still come back (re-deferred after a
-- failure, or deferred behind the key by the consumer's gate) with a lower
-- seq than what waits here; published now, a later message would overtake
-- it (docs/design.md section 23.3). This clears that lease for the keys of
-- the deleted rows that have none left, in key order, and deletes the row
-- of such a key that no message waits in (an emptied row, head_id 0: see
-- deferred_key_refresh.sql).
CREATE OR REPLACE FUNCTION deferred_inflight_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    freed text[];
BEGIN
    PERFORM deferred_require_read_committed(TG_TABLE_NAME);
    SELECT array_agg(DISTINCT o.business_key ORDER BY o.business_key) INTO freed
    FROM old_rows o
    WHERE NOT EXISTS (SELECT FROM deferred_inflight i WHERE i.business_key = o.business_key);
    IF freed IS NULL THEN
        RETURN NULL;
    END IF;
    -- Locked in key order, as every head writer locks them.
    PERFORM 1 FROM deferred_key k
    WHERE k.business_key = ANY (freed) AND k.leased_by = 'in-flight'
    ORDER BY k.business_key
    FOR UPDATE;
    DELETE FROM deferred_key k
    WHERE k.business_key = ANY (freed) AND k.leased_by = 'in-flight' AND k.head_id = 0;
    UPDATE deferred_key k
    SET leased_by = NULL, leased_until = NULL
    WHERE k.business_key = ANY (freed) AND k.leased_by = 'in-flight';
    RETURN NULL;
END
$$;
