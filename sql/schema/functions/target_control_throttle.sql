-- target_control_throttle: the AFTER row trigger of target_control that
-- re-flags the heads of each target whose throttling an operator's change
-- turned on or off (deferred_key_rethrottle).

CREATE OR REPLACE FUNCTION target_control_throttle() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM deferred_require_read_committed(TG_TABLE_NAME);
    IF TG_OP = 'INSERT' THEN
        IF NEW.paused OR NEW.rate_limit IS NOT NULL THEN
            PERFORM deferred_key_rethrottle(NEW.target_topic);
        END IF;
    ELSIF TG_OP = 'DELETE' THEN
        IF OLD.paused OR OLD.rate_limit IS NOT NULL THEN
            PERFORM deferred_key_rethrottle(OLD.target_topic);
        END IF;
    ELSIF NEW.target_topic IS DISTINCT FROM OLD.target_topic THEN
        PERFORM deferred_key_rethrottle(OLD.target_topic);
        PERFORM deferred_key_rethrottle(NEW.target_topic);
    ELSIF (NEW.paused OR NEW.rate_limit IS NOT NULL) IS DISTINCT FROM (OLD.paused OR OLD.rate_limit IS NOT NULL) THEN
        PERFORM deferred_key_rethrottle(NEW.target_topic);
    END IF;
    RETURN NULL;
END
$$;
