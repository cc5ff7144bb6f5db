-- target_control_notify wakes the dispatchers when an operator changes what
-- a target may do (pause, resume, rate limit; see triggers/target_control.sql
-- for which statements fire it).

CREATE OR REPLACE FUNCTION target_control_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('deferred_key_due', '');
    RETURN NULL;
END
$$;
