-- deferred_key_change_released: a key whose in-flight row goes (the group
-- committed past its record, or an operator released it) may be free for
-- the group: tell the group's blocked-key sets (deferred_key_change).
CREATE OR REPLACE FUNCTION deferred_key_change_released() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_key_change (group_id, business_key)
    SELECT DISTINCT o.group_id, o.business_key
    FROM old_rows o;
    RETURN NULL;
END
$$;
