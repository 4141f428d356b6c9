def register():
    pass
