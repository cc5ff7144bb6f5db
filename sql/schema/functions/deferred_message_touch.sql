-- deferred_message_touch: the BEFORE UPDATE row trigger of deferred_message.
--
-- updated_at follows every change an operator or the service makes.
--
-- parked_at follows the state; leaving the parking lot also forgets that a
-- dead-letter copy was sent, so parking again sends a new one, at once: the
-- lease (or back-off) of the old copy goes too. A publisher still sending
-- the old copy then does not mark the new stay's copy sent: it marks only a
-- row whose parked_at is the one it read (dlq_mark_published.sql).

CREATE OR REPLACE FUNCTION deferred_message_touch() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NEW.state = 'parked' THEN
            NEW.parked_at := now();
        ELSE
            NEW.parked_at := NULL;
        END IF;
        IF OLD.state = 'parked' THEN
            NEW.dlq_published_at := NULL;
            NEW.dlq_leased_until := NULL;
        END IF;
    END IF;
    RETURN NEW;
END
$$;
