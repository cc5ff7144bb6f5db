-- target_control_after_truncate: TRUNCATE waits for every transaction that
-- read target_control, so no head writer can be flagging a head meanwhile;
-- with no target throttled any more, no head is.

CREATE OR REPLACE FUNCTION target_control_after_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE deferred_key SET throttled = false WHERE throttled;
    RETURN NULL;
END
$$;
