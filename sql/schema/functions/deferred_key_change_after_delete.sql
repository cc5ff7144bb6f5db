-- deferred_key_change_after_delete: a message of a consumer group deleted
-- while it blocked its key (an operator's cancel) may free the key for the
-- group: tell the group's blocked-key sets (deferred_key_change). The
-- finalize's deletes do not call it (triggers/deferred_message.sql): the
-- same statement puts the key in flight, so it stays blocked.
CREATE OR REPLACE FUNCTION deferred_key_change_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_key_change (group_id, business_key)
    SELECT DISTINCT o.group_id, o.business_key
    FROM old_rows o
    WHERE o.group_id IS NOT NULL AND o.business_key IS NOT NULL
      AND (o.state IN ('pending', 'rejected') OR (o.state = 'parked' AND o.park_holds_key));
    RETURN NULL;
END
$$;
