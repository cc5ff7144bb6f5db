-- deferred_inflight_after_truncate: TRUNCATE deferred_inflight releases
-- every key in flight, as deleting every row would
-- (deferred_inflight_after_delete.sql), which a statement trigger on
-- DELETE does not see.
CREATE OR REPLACE FUNCTION deferred_inflight_after_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM deferred_key k WHERE k.leased_by = 'in-flight' ORDER BY k.business_key FOR UPDATE;
    DELETE FROM deferred_key k WHERE k.leased_by = 'in-flight' AND k.head_id = 0;
    UPDATE deferred_key k SET leased_by = NULL, leased_until = NULL WHERE k.leased_by = 'in-flight';
    RETURN NULL;
END
$$;
